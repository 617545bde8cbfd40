"""The runtime, above dispatch: the torch op (`op`: verify_attention), its input checks
(`inputs`), kernel loading and launching (`launch`), workspace and TMA descriptors
(`workspace`, `tensormap`), the drop-in pieces (`varlen`, `merge`, `ops`: the custom op) and the
fp64 reference (`reference`). `mlagen.compat` sits at this layer too.
"""

"""Code generation, above the plans: `render` turns a KernelPlan into CUDA C++ through the
Jinja templates, `compiler` compiles it with NVRTC into the disk cache, `build` does both for a
(problem, variant) and `precompile` many in parallel processes.
"""

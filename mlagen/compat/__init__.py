"""Drop-in replacements for other attention libraries' public APIs, backed by mlagen kernels.

`mlagen.compat.flash_mla`: FlashMLA's decode API (`get_mla_metadata` in both its forms,
`flash_mla_with_kvcache` with several KV heads, attention sinks and its sparse call over top-k
indices); switch with `import mlagen.compat.flash_mla as flash_mla`.
"""

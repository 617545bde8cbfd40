"""Plans, above the DSL: `validate` checks a (problem, variant) and derives its KernelPlan
(`families` and `schedules` are the registries of the kernel families and the tile loop's
schedules, `mma_plan` holds the tensor-core family's layout rules), `params` the kernel's parameter block
and `space` the variant space the tuner searches. Imports only from the DSL.
"""

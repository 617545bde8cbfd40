"""The DSL's error type and the rule helpers that raise it.

`SpecError` names the field, the value and the limit a problem or variant breaks; `require` and
`require_smem` are how the planners (`validate`) state their rules.
"""

from __future__ import annotations

from .arch import Arch


class SpecError(ValueError):
    """A problem or variant that cannot be built, with the field, the value and the limit."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        self.field, self.value, self.expected = field, value, expected
        super().__init__(f"{field}: got {value!r}, expected {expected}")


def require(ok: bool, field: str, value: object, expected: str) -> None:
    if not ok:
        raise SpecError(field, value, expected)


def require_smem(arch: Arch, smem: int, what: str) -> None:
    require(smem <= arch.smem_per_block, "variant", what,
            f"at most {arch.smem_per_block} bytes of shared memory per block on {arch.name}, "
            f"this variant needs {smem}")

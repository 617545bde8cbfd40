from .validate import SpecError


def plan_mma(p, v, arch):
    raise SpecError("variant.family", "mma", "not yet")

"""spec -> validate -> render -> compile, in one call: what the runtime, emit and tune share."""

from __future__ import annotations

from dataclasses import dataclass

from ..dsl.spec import Problem, Variant
from ..plan.validate import KernelPlan, validate
from .compiler import CompiledModule, compile_source
from .render import render


@dataclass(frozen=True)
class Built:
    plan: KernelPlan
    source: str
    module: CompiledModule


def build(problem: Problem, variant: Variant, *, use_cache: bool = True) -> Built:
    """Validate, render and compile one (problem, variant); raises SpecError or CompileError."""
    plan = validate(problem, variant)
    source = render(plan)
    module = compile_source(source, plan.name, plan.arch.name, use_cache=use_cache)
    return Built(plan=plan, source=source, module=module)

"""Rendering: a validated `KernelPlan` becomes one self-contained CUDA C++ source.

Templates live in `templates/` (shared fragments are `*.cuh.j2`, one `<family>.cu.j2` per
kernel family). They carry constants and `static_assert`s; every number and flag comes from the
plan: templates read `plan` attributes only, never its variant. The kernel's constants are
defined once, in the traits block (`traits.cuh.j2`) at the top of the kernel's one namespace,
and the fragments read them by name.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from ..dsl.arch import nvcc_arch_flags
from ..plan.params import FIELDS
from ..plan.validate import KernelPlan

_PACKAGE = Path(__file__).resolve().parents[1]  # the mlagen package
_SOURCE_TREE_TEMPLATES = _PACKAGE.parent / "templates"


def template_dir() -> Path:
    """Where the templates are: beside the package in a checkout, inside it when installed."""
    if _SOURCE_TREE_TEMPLATES.is_dir():
        return _SOURCE_TREE_TEMPLATES
    return _PACKAGE / "templates"


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The Jinja environment over `template_dir()` (the kernels' and the launchers' templates)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
        lstrip_blocks=False,
        autoescape=False,
    )


@functools.lru_cache(maxsize=512)
def render(plan: KernelPlan) -> str:
    """The CUDA C++ source of `plan`: its kernel (with the merge blocks of split families)."""
    template = environment().get_template(plan.template)
    return template.render(plan=plan, fields=FIELDS, arch_flags=nvcc_arch_flags(plan.arch.name))

"""Compile many (problem, variant) pairs in parallel processes, into the disk cache.

NVRTC needs no GPU, so workers only compile; the caller's process later loads the cubins from
the disk cache. Workers start with "spawn": the caller may already hold a CUDA context, which a
forked child must not inherit.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed

from ..dsl.errors import SpecError
from ..dsl.spec import Problem, Variant
from .build import build
from .compiler import CompileError


def code_identity(problem: Problem, variant: Variant) -> tuple[Problem, Variant]:
    """Pairs with the same identity compile to the same code (`Variant.code_variant`)."""
    return problem, variant.code_variant


def compile_one(problem: Problem, variant: Variant) -> str:
    """'' when (problem, variant) compiles, else why not."""
    try:
        build(problem, variant)
        return ""
    except (SpecError, CompileError) as e:
        return f"{type(e).__name__}: {e}"


def precompile(jobs: Iterable[tuple[Problem, Variant]], workers: int | None = None,
               on_done: Callable[[int], None] | None = None) -> dict[tuple[Problem, Variant], str]:
    """Compile every distinct code of `jobs`; returns {code_identity: error or ''}.

    on_done(total) is called once per finished compile (e.g. to advance a progress bar).
    A crashed worker marks its job failed; it never raises.
    """
    unique = list(dict.fromkeys(code_identity(p, v) for p, v in jobs))
    workers = max(1, min(workers or os.cpu_count() or 1, len(unique)))
    results: dict[tuple[Problem, Variant], str] = {}
    if workers == 1:
        for key in unique:
            results[key] = compile_one(*key)
            if on_done:
                on_done(len(unique))
        return results
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(compile_one, *key): key for key in unique}
            for f in as_completed(futures):
                try:
                    results[futures[f]] = f.result()
                except Exception as e:      # a worker that died: score the job failed, go on
                    results[futures[f]] = f"worker failed: {e!r}"
                if on_done:
                    on_done(len(unique))
    except (OSError, RuntimeError):         # no process pool here: compile what is left in-process
        for key in unique:
            if key not in results:
                results[key] = compile_one(*key)
                if on_done:
                    on_done(len(unique))
    return results

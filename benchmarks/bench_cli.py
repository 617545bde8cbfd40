"""What the scripts in benchmarks/ share: a command line whose --help is the script's docstring,
and a one-line exit, not a traceback, where no CUDA GPU is visible."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent   # the repository (its templates/ are the default tree)


def parser(script: str, doc: str | None) -> argparse.ArgumentParser:
    """An argument parser named after `script` (its __file__) whose --help prints `doc`."""
    return argparse.ArgumentParser(prog=Path(script).name, description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def variant_name(text: str) -> str:
    """An argparse type: `text` when it names a variant (`mlagen.dsl.spec.parse_variant`), else the reason."""
    from mlagen.dsl.spec import parse_variant

    try:
        parse_variant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def gpu_missing() -> str | None:
    """Why no CUDA GPU can run here, or None where torch sees one."""
    try:
        import torch

        if torch.cuda.is_available():
            return None
        return f"torch {torch.__version__} sees no CUDA device"
    except Exception as e:   # a broken driver or torch install: the reason is the message
        return f"{type(e).__name__}: {e}"


def require_gpu(script: str) -> None:
    """Exit with one line naming `script` where no CUDA GPU is visible."""
    reason = gpu_missing()
    if reason is not None:
        raise SystemExit(f"{Path(script).name} needs a CUDA GPU ({reason}); run it on the GPU machine "
                         "(benchmarks/README.md)")

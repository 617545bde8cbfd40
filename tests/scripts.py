"""The repository's scripts (docs/make_api.py, examples/*.py) as modules, for the tests that
call their functions."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_script(path: str) -> ModuleType:
    """The script at `path` (relative to the repository root) loaded as a module of its own."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

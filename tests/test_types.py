"""The DSL, the plans, the code generator, the runtime and the dispatcher type-check: mypy over
their packages finds nothing. Imports of other packages are followed silently (their errors are
not these packages'), and packages without type information are taken as they come."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("mlagen/dsl", "mlagen/plan", "mlagen/codegen", "mlagen/runtime", "mlagen/dispatch")


def test_dsl_plan_codegen_runtime_and_dispatch_type_check(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports", "--no-error-summary",
         "--cache-dir", str(tmp_path), *CHECKED],
        cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr

"""The DSL, the plans, the code generator, the runtime and the dispatcher type-check: mypy over
their packages finds nothing. Imports of other packages are followed silently (their errors are
not these packages'), and packages without type information are taken as they come."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("mlagen/dsl", "mlagen/plan", "mlagen/codegen", "mlagen/runtime", "mlagen/dispatch")


# Calls as a user writes them, with the types the entry points' overloads give them; and a call
# with a misspelled keyword, which the overloads must refuse.
CALLS = """
from typing import assert_type
import torch
from mlagen import verify_attention, verify_attention_varlen

q = kv = bt = lens = cu = torch.empty(0)
flag = bool(len(q))
assert_type(verify_attention(q, kv, bt, lens, causal=False, out=q), torch.Tensor)
assert_type(verify_attention(q, kv, bt, lens, return_lse=True, kv_scale=0.5), tuple[torch.Tensor, torch.Tensor])
assert_type(verify_attention(q, kv, indices=bt, return_lse=flag), torch.Tensor | tuple[torch.Tensor, torch.Tensor])
assert_type(verify_attention_varlen(q, kv, bt, lens, cu, 4, tree_mask=q), torch.Tensor)
assert_type(verify_attention_varlen(q, kv, bt, lens, cu, 4, return_lse=True), tuple[torch.Tensor, torch.Tensor])
verify_attention(q, kv, bt, lens, softmax_scal=0.1)  # E: the misspelled keyword
"""


def test_dsl_plan_codegen_runtime_and_dispatch_type_check(tmp_path):
    """mypy finds nothing in the packages, and in the calls only the misspelled keyword."""
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    calls = tmp_path / "calls.py"
    calls.write_text(CALLS)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports", "--no-error-summary",
         "--python-version", "3.11", "--cache-dir", str(tmp_path / "cache"), *CHECKED, str(calls)],
        cwd=ROOT, capture_output=True, text=True, check=False)
    flagged = {str(i + 1) for i, line in enumerate(CALLS.splitlines()) if "# E:" in line}
    errors = {tuple(line.split(":")[:2]) for line in result.stdout.splitlines() if ": error:" in line}
    assert errors == {(str(calls), n) for n in flagged}, result.stdout + result.stderr

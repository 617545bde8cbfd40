"""docs/api.md must match what docs/make_api.py renders from the code now; the guide's
commands and names must exist."""

import doctest
import importlib.util
import re
from pathlib import Path

import mlagen

ROOT = Path(__file__).resolve().parent.parent


def _make_api():
    spec = importlib.util.spec_from_file_location("make_api", ROOT / "docs" / "make_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date():
    committed = (ROOT / "docs" / "api.md").read_text()
    assert committed == _make_api().render(), "docs/api.md is stale: run python docs/make_api.py"


def test_guide_names_real_functions():
    guide = (ROOT / "docs" / "guide.md").read_text()
    for name in re.findall(r"\bmlagen\.(\w+)\(", guide):
        assert hasattr(mlagen, name), f"guide.md calls mlagen.{name}, which mlagen does not export"
    assert "from mlagen.compat.flash_mla import" in guide


def test_guide_dispatcher_example_runs():
    """The guide's dispatcher session, run as a doctest against the shipped table."""
    guide = (ROOT / "docs" / "guide.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if "choose_variant" in b)
    test = doctest.DocTestParser().get_doctest(block, {}, "guide.md dispatcher", "guide.md", 0)
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.failures == 0 and runner.tries >= 8

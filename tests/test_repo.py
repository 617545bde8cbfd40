"""The repository's promises: CI runs exactly the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands(text: str) -> list[str]:
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_ci_runs_the_readme_test_command():
    main_job, test_command = _commands((ROOT / "README.md").read_text())
    assert "mlagen emit" in main_job and main_job.startswith("pip install torch==2.13.0")
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()

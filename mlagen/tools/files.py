"""Writing generated files: `emit`'s kernels and manifests and `launcher`'s headers."""

from __future__ import annotations

from pathlib import Path


def write_if_changed(path: Path, text: str) -> bool:
    """Write `text` to `path` (creating its folder) unless the file already holds it; returns
    whether it wrote. Keeps emitted files' timestamps stable for build systems."""
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True

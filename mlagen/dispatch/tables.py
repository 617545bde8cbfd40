"""Tuned dispatch tables: which variant won for each shape bucket on one GPU.

A table is a JSON file for one (GPU name, arch):

    {"format": 1, "gpu": "NVIDIA H200", "arch": "sm_90", "meta": {...},
     "entries": {"<bucket key>": {"variant": "<name>", "us": 12.3,
                                  "families": {"flash": {"variant": "<name>", "us": 12.3}, ...},
                                  "row": [H, B, S, prefix], "candidates": 40, "failed": 0}}}

Bucket key: heads, Dl, Dr, dtype, an FP8 format, page size, mask kind, S exactly, and round(log2) of the
batch and of the KV capacity (block_table columns x page size; the op never reads lengths on
the host). Tables come from two places, merged per (GPU, arch), the user's winning:
- shipped defaults: mlagen/dispatch/tables/*.json (filled by `mlagen tune --write-default`);
- the user's: $MLAGEN_TUNE_DIR, else tables/ beside the compile cache (`mlagen tune` writes it).
They are read once per process (`entries_for` caches); `reset` forgets them after a tune.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..codegen.compiler import cache_dir
from ..dsl.spec import Problem

FORMAT = 1
ENV_DIR = "MLAGEN_TUNE_DIR"
SHIPPED_DIR = Path(__file__).resolve().parent / "tables"


def log2_bucket(n: int) -> int:
    """round(log2(n)), n >= 1 (0 for n <= 1): a bucket spans a factor of two around 2**k."""
    return round(math.log2(n)) if n > 1 else 0


def bucket_key(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int,
               mask: str | None = None) -> str:
    """The table key of a shape; `mask` overrides the problem's mask kind. An FP8 cache or FP8
    queries add their format ("_kve4m3", "_qe4m3"), so 16-bit keys read as they always did."""
    p = problem
    fp8 = (f"_kv{p.kv_format}" if p.fp8_kv else "") + (f"_q{p.q_format}" if p.fp8_q else "")
    return (f"h{p.heads}_dl{p.dl}_dr{p.dr}_{p.dtype}{fp8}_p{p.page_size}_{mask or p.mask}"
            f"_s{seqlen_q}_b{log2_bucket(batch)}_n{log2_bucket(kv_capacity)}")


@dataclass
class Table:
    gpu: str
    arch: str
    entries: dict[str, dict] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "gpu": self.gpu, "arch": self.arch, "meta": self.meta,
                           "entries": dict(sorted(self.entries.items()))}, indent=1) + "\n"


def load_table(path: Path) -> Table:
    """Read a table file; raises ValueError for another format or a malformed file."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON table ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: got table format {data.get('format') if isinstance(data, dict) else data!r}, "
                         f"expected {FORMAT}")
    return Table(gpu=data["gpu"], arch=data["arch"], entries=dict(data.get("entries", {})),
                 meta=dict(data.get("meta", {})))


def save_table(table: Table, path: Path) -> None:
    """Write atomically (a reader sees the old table or the new one, never half of one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(table.to_json())
    os.replace(tmp, path)


def gpu_slug(gpu: str) -> str:
    """'NVIDIA H200' -> 'h200': a file-name form of a GPU name."""
    name = re.sub(r"^nvidia\s+", "", gpu.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def user_dir() -> Path:
    env = os.environ.get(ENV_DIR)
    return Path(env) if env else cache_dir().parent / "tables"


def user_table_path(gpu: str, arch: str) -> Path:
    return user_dir() / f"{gpu_slug(gpu)}_{arch}.json"


def default_table_path(gpu: str) -> Path:
    """The shipped table of a GPU, inside the package (what `--write-default` writes)."""
    return SHIPPED_DIR / f"{gpu_slug(gpu)}.json"


def _read_if_for(path: Path, gpu: str, arch: str) -> dict[str, dict]:
    try:
        t = load_table(path)
    except (OSError, ValueError, KeyError):
        return {}        # a broken table must not break the op: the heuristic takes over
    return t.entries if (t.gpu, t.arch) == (gpu, arch) else {}


@functools.lru_cache(maxsize=16)
def entries_for(gpu: str, arch: str) -> dict[str, dict]:
    """Every tuned entry for this GPU and arch: shipped tables, then the user's over them."""
    merged: dict[str, dict] = {}
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        merged.update(_read_if_for(path, gpu, arch))
    merged.update(_read_if_for(user_table_path(gpu, arch), gpu, arch))
    return merged


def reset() -> None:
    """Forget the tables read so far (after `mlagen tune` wrote one)."""
    entries_for.cache_clear()

"""Benchmark shapes: the named grids of `mlagen bench` / `mlagen tune` and custom rows."""

from __future__ import annotations

from dataclasses import dataclass

from .peers import PEERS


@dataclass(frozen=True, order=True)
class Row:
    """One benchmark shape: H heads, B requests of S draft tokens after `prefix` keys each."""

    heads: int
    batch: int
    seqlen_q: int
    prefix: int

    @property
    def keys(self) -> int:
        """N, valid keys per request (the draft tokens included)."""
        return self.prefix + self.seqlen_q

    def kv_capacity(self, page_size: int) -> int:
        """Keys the bench's and the tuner's block tables address: N rounded up to whole pages."""
        return -(-self.keys // page_size) * page_size

    @property
    def group(self) -> str:
        """The plot panel / table group: everything but the prefix."""
        return f"H={self.heads} B={self.batch} S={self.seqlen_q}"

    def __str__(self) -> str:
        return f"{self.heads},{self.batch},{self.seqlen_q},{self.prefix}"


SEED: tuple[Row, ...] = tuple(
    Row(64, 1, s, p) for s in (9, 33) for p in (256, 1024, 4096, 16384, 65536)
)
SERVING: tuple[Row, ...] = tuple(Row(*p.shape) for p in PEERS)
# Wide draft trees, which the other grids lack: S = 33 on a batch and S = 64, the most a tree mask
# holds, where a tree's draft-token tiles are the largest share of the work.
TREES: tuple[Row, ...] = (Row(64, 8, 33, 4096), Row(64, 1, 64, 4096), Row(64, 8, 64, 4096),
                          Row(64, 1, 64, 65536), Row(16, 64, 64, 4096), Row(8, 16, 64, 16384))
GRIDS: dict[str, tuple[Row, ...]] = {"seed": SEED, "serving": SERVING, "trees": TREES}


def parse_row(text: str) -> Row:
    """'H,B,S,prefix' -> Row; raises ValueError naming what is wrong."""
    parts = text.replace(" ", "").split(",")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--row: got {text!r}, expected H,B,S,prefix (four integers, e.g. 64,1,9,4096)")
    heads, batch, seqlen_q, prefix = map(int, parts)
    if heads < 1 or batch < 1 or not 1 <= seqlen_q <= 64:
        raise ValueError(f"--row: got {text!r}, expected H >= 1, B >= 1 and 1 <= S <= 64")
    return Row(heads, batch, seqlen_q, prefix)


def select_rows(grids: list[str], rows: list[str]) -> list[tuple[Row, tuple[str, ...]]]:
    """The rows of the named grids then the custom ones, each once, with the grids it is in
    ('custom' for --row). Raises ValueError for an unknown grid or a malformed row."""
    found: dict[Row, list[str]] = {}
    for name in grids:
        if name not in GRIDS:
            raise ValueError(f"--grid: got {name!r}, expected one of {', '.join(GRIDS)}")
        for r in GRIDS[name]:
            found.setdefault(r, []).append(name)
    for text in rows:
        found.setdefault(parse_row(text), []).append("custom")
    return [(r, tuple(dict.fromkeys(g))) for r, g in found.items()]

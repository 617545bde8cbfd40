"""Tile shapes: the (head_tile, q_tile) pairs a block can hold for a problem's heads and a draft
length, the one enumeration that the tuner's search space (`space.tile_shapes`), the
dispatcher's heuristics (`mlagen.dispatch.policy`) and the fuzzer's random variants
(`mlagen.tools.fuzz.draw_variant`) each filter and order their own way.

A block holds head_tile heads (a divisor of the problem's heads, so that no head tile is
ragged) of q_tile draft positions (at most the draft's and `validate.MAX_SEQLEN_Q`): q_tile *
head_tile query rows. A balanced q tile cuts the draft into tiles of as equal length as their
count allows: ceil(S/n) for n tiles, the smallest q tile that takes n tiles, so that no tile
holds more padding than the count needs.
"""

from __future__ import annotations

from ..dsl.spec import MAX_SEQLEN_Q

MAX_ROWS = 128          # q_tile * head_tile beyond this fits no family's block (at Dl=256; wider Dl, fewer)
FLASH_Q_TILE = 8        # the flash heuristic's q tiles: balanced, of at most this many positions


def head_tiles(heads: int) -> list[int]:
    """The head tiles of a problem of `heads` heads: its divisors, ascending."""
    return [d for d in range(1, heads + 1) if heads % d == 0]


def balanced_q_tile(seqlen_q: int, most: int) -> int:
    """The largest balanced q tile of S=seqlen_q positions (ceil(S/n) for n tiles) that holds at
    most `most` positions: the draft cut into the fewest tiles of at most `most`, as equal as
    their count allows. A q tile is balanced where it is its own `balanced_q_tile`."""
    return -(-seqlen_q // -(-seqlen_q // most))


def enumerate_tiles(heads: int, seqlen_q: int, max_rows: int = MAX_ROWS,
                    balanced: bool = False) -> list[tuple[int, int]]:
    """Every (head_tile, q_tile) pair for `heads` heads and S=seqlen_q draft positions, head
    tile ascending, then q tile ascending.

    heads: the problem's heads; each head_tile divides it (`head_tiles`).
    seqlen_q: positions of a request's draft; each q_tile is at most this and
        `validate.MAX_SEQLEN_Q` (a block's tree mask rows).
    max_rows: rows of a block at most: head_tile * q_tile <= max_rows (default `MAX_ROWS`).
    balanced: only the balanced q tiles of the draft (ceil(S/n) for n tiles), else every length.

    Which of them a variant of a family on an arch takes is `validate`'s to say."""
    q_tiles = [q for q in range(1, min(seqlen_q, MAX_SEQLEN_Q) + 1)
               if not balanced or balanced_q_tile(seqlen_q, q) == q]
    return [(h, q) for h in head_tiles(heads) for q in q_tiles if h * q <= max_rows]

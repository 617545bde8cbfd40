"""The balanced split's work list as templates/split_work_list.cuh.j2 lays it out, step for step in Python:
the CPU tests work the kernel's ranges through with it, and the GPU tests ask it which layout a
launch takes."""

from __future__ import annotations

from dataclasses import dataclass


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WorkList:
    tiles: list[int]    # each request's KV tiles
    cost: int           # SEGMENT_TILES
    ranges: int         # gridDim.y
    total: int          # the list's length in positions
    per: int            # a range's length
    aligned: int        # the most tiles an aligned range holds; 0: packed

    def span(self, b: int) -> int:
        t = self.tiles[b]
        if t == 0:
            return 0
        return _ceil(t, self.aligned) * self.per if self.aligned else self.cost + t

    def start(self, b: int) -> int:
        return sum(self.span(k) for k in range(b))

    def request_at(self, u: int) -> int:
        """The request whose positions hold u (len(tiles) past the list)."""
        return next((b for b in range(len(self.tiles)) if self.span(b) and self.start(b) <= u < self.start(b) +
                     self.span(b)), len(self.tiles))

    def splits(self, b: int) -> tuple[int, int]:
        """(first range, ranges) of request b: what its merge reads."""
        t, start = self.tiles[b], self.start(b)
        if t == 0:
            return 0, 0
        if self.aligned:
            return start // self.per, _ceil(t, self.aligned)
        first = (start + self.cost) // self.per
        return first, (start + self.cost + t - 1) // self.per - first + 1

    def range_tiles(self, b: int, u0: int, u1: int) -> range:
        """Request b's tiles that range [u0, u1) runs."""
        t, start = self.tiles[b], self.start(b)
        if t == 0:
            return range(0)
        if self.aligned:                    # range j of k: t // k tiles, one more while j < t % k
            k, j = _ceil(t, self.aligned), (u0 - start) // self.per
            q, r = divmod(t, k)
            t0 = j * q + min(j, r)
            return range(t0, t0 + q + (j < r))
        at = start + self.cost
        return range(max(u0, at) - at, min(u1, at + t) - at)


def aligned_ranges(tiles: list[int], m: int) -> int:
    return sum(_ceil(t, m) for t in tiles)


def packed_list(tiles: list[int], ranges: int, cost: int) -> WorkList:
    """The packed layout: each request's cost, then its tiles, cut into equal ranges."""
    total = sum(tiles) + cost * sum(t > 0 for t in tiles)
    return WorkList(tiles, cost, ranges, total, _ceil(total, ranges), 0)


def work_list(tiles: list[int], ranges: int, cost: int, unsplit_slack: int) -> WorkList:
    """balanced_ranges: aligned when its ranges hold no more tiles than packed ones hold positions,
    or `unsplit_slack` more when every request then takes one range; packed otherwise."""
    packed = packed_list(tiles, ranges, cost)
    if sum(tiles) == 0 or sum(t > 0 for t in tiles) > ranges:
        return packed
    m = max(tiles)
    if aligned_ranges(tiles, packed.per) <= ranges:
        lo, hi = _ceil(sum(tiles), ranges), packed.per
        while lo < hi:
            mid = (lo + hi) // 2
            if aligned_ranges(tiles, mid) <= ranges:
                hi = mid
            else:
                lo = mid + 1
        m = hi
    elif m > packed.per + unsplit_slack:
        return packed
    return WorkList(tiles, cost, ranges, aligned_ranges(tiles, m) * (cost + m), cost + m, m)


def real_tiles(count: int, seqlen_q: int, q_tile: int) -> tuple[int, int]:
    """Ragged rows: (first real query tile, real tiles) of a request whose last `count` of
    seqlen_q rows are real (split_work_list.cuh.j2, real_tiles)."""
    tiles, first = _ceil(seqlen_q, q_tile), (seqlen_q - count) // q_tile
    return first, (tiles - first if count > 0 else 0)


def rotations(counts: list[int], seqlen_q: int, q_tile: int) -> list[int]:
    """rot_b: the real query tiles of the requests before b, modulo the query tiles."""
    tiles, out, total = _ceil(seqlen_q, q_tile), [], 0
    for c in counts:
        out.append(total % tiles)
        total += real_tiles(c, seqlen_q, q_tile)[1]
    return out


def slot_q_tile(count: int, rot: int, slot: int, seqlen_q: int, q_tile: int) -> int:
    """The query tile of a request (its count, rot_b) that query-tile slot `slot` holds, or -1."""
    first, real = real_tiles(count, seqlen_q, q_tile)
    k = (slot - rot) % _ceil(seqlen_q, q_tile)
    return first + k if k < real else -1

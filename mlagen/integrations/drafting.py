"""Draft trees for speculative decoding: their shape, prompt-lookup drafting, greedy acceptance.

A draft tree holds S nodes in topological order. Node 0 is the root: the request's pending token,
the one the model chose last, whose cache row is not written yet. Every other node k is a drafted
token whose parent is an earlier node. A node's position is its parent's plus one, so a node at
depth d sits at position (cache length + d), and query k sees its ancestors and itself (the
`mask`). A chain is the tree in which node k's parent is k - 1: its mask is the causal one.

Prompt lookup (`prompt_lookup`) drafts without a second model: the last few tokens are looked up
earlier in the text, and what followed each earlier occurrence is a candidate continuation.
`DraftTree.from_paths` merges candidates into one tree (shared prefixes become shared nodes).

Greedy acceptance (`accept_greedy`) walks from the root: the model's greedy choice at a node is
accepted while a child of that node carries it. The accepted nodes' cache rows are kept, and the
emitted tokens are the accepted children's plus the greedy choice at the last accepted node, so
each verify step emits at least one token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..dsl.spec import MAX_SEQLEN_Q

PAD_TOKEN = -1          # a padding node's token: never accepted, embedded as token 0


@dataclass(frozen=True)
class DraftTree:
    """S draft nodes in topological order: tokens[k] and parents[k] (parents[0] = -1, the root;
    parents[k] < k otherwise). A token of PAD_TOKEN marks a padding node (`padded`)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError(f"tree: got {len(self.tokens)} tokens and {len(self.parents)} parents, expected the same "
                             "number, at least one (the root)")
        if self.parents[0] != -1 or any(not 0 <= p < k for k, p in enumerate(self.parents) if k):
            raise ValueError(f"tree.parents: got {list(self.parents)}, expected -1 for node 0 and an earlier node "
                             "for each other node")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """The chain tokens[0] -> tokens[1] -> ...; tokens[0] is the root (pending token)."""
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def from_paths(cls, root: int, paths: Sequence[Sequence[int]], max_nodes: int = MAX_SEQLEN_Q) -> DraftTree:
        """The tree of `root` followed by each path of draft tokens, merged where paths share a
        prefix (a trie), with at most max_nodes nodes: paths are added in order, and a path's
        tokens past the node budget are left out."""
        tokens, parents = [int(root)], [-1]
        children: dict[tuple[int, int], int] = {}          # (parent node, token) -> node
        for path in paths:
            node = 0
            for token in path:
                child = children.get((node, int(token)))
                if child is None:
                    if len(tokens) >= max_nodes:
                        break
                    child = len(tokens)
                    children[(node, int(token))] = child
                    tokens.append(int(token))
                    parents.append(node)
                node = child
        return cls(tuple(tokens), tuple(parents))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Whether node k's parent is k - 1 for every k (the causal mask)."""
        return all(p == k - 1 for k, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's depth: 0 for the root, its parent's plus one otherwise."""
        depth = [0] * len(self)
        for k in range(1, len(self)):
            depth[k] = depth[self.parents[k]] + 1
        return depth

    def mask(self) -> torch.Tensor:
        """Bool [S, S]: mask[i, k] when node k is node i or one of its ancestors."""
        rows: list[int] = []
        for k, p in enumerate(self.parents):
            rows.append((1 << k) | (rows[p] if p >= 0 else 0))
        return torch.tensor([[bool(r >> k & 1) for k in range(len(self))] for r in rows], dtype=torch.bool)

    def padded(self, size: int) -> DraftTree:
        """This tree with padding nodes appended up to `size` nodes, each the child of the node
        before it: a chain stays a chain, and no real node sees a padding node."""
        if size < len(self):
            raise ValueError(f"size: got {size}, expected at least the tree's {len(self)} nodes")
        extra = size - len(self)
        return DraftTree(self.tokens + (PAD_TOKEN,) * extra, self.parents + tuple(range(len(self) - 1, size - 1)))


def prompt_lookup(tokens: Sequence[int], *, max_ngram: int = 3, min_ngram: int = 1, draft_len: int = 8,
                  max_candidates: int = 1) -> list[list[int]]:
    """Candidate continuations of `tokens` (prompt and text so far) by n-gram lookup.

    For n from max_ngram down to min_ngram, each earlier occurrence of the last n tokens (most
    recent first) proposes the up to draft_len tokens that followed it. Returns at most
    max_candidates distinct non-empty candidates, longest n-grams first; [] when nothing matches.
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"max_ngram, min_ngram: got {max_ngram}, {min_ngram}, expected max_ngram >= min_ngram >= 1")
    seq = [int(t) for t in tokens]
    found: list[list[int]] = []
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):     # occurrences that have a token after them
            if seq[start:start + n] == suffix:
                candidate = seq[start + n:start + n + draft_len]
                if candidate not in found:
                    found.append(candidate)
                    if len(found) >= max_candidates:
                        return found
    return found


def lookup_tree(tokens: Sequence[int], *, draft_len: int = 8, branches: int = 1, max_ngram: int = 3,
                max_nodes: int = MAX_SEQLEN_Q) -> DraftTree:
    """The draft tree rooted at tokens[-1] (the pending token) from `prompt_lookup`'s candidates:
    a chain with branches = 1, otherwise up to `branches` candidates merged. Just the root when
    nothing matches."""
    paths = prompt_lookup(tokens, max_ngram=max_ngram, draft_len=draft_len, max_candidates=branches)
    return DraftTree.from_paths(tokens[-1], paths, max_nodes=max_nodes)


def accept_greedy(tree: DraftTree, greedy: Sequence[int]) -> tuple[list[int], list[int]]:
    """The greedy walk through a verified tree.

    greedy[k]: the model's greedy choice after node k (argmax of its logits). Returns (accepted
    nodes: the root and each node reached, in order; emitted tokens: the reached nodes' tokens,
    then the greedy choice at the last accepted node). A padding node is never reached.
    """
    children: dict[tuple[int, int], int] = {}
    for k in range(1, len(tree)):
        if tree.tokens[k] != PAD_TOKEN:
            children.setdefault((tree.parents[k], tree.tokens[k]), k)
    node, accepted, emitted = 0, [0], []
    while True:
        choice = int(greedy[node])
        emitted.append(choice)
        child = children.get((node, choice))
        if child is None:
            return accepted, emitted
        node = child
        accepted.append(node)

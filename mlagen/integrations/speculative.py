"""Greedy speculative decoding of a batch of requests on a `DeepseekV3Verifier`.

Each request keeps its text (prompt, then generated tokens); its last token is pending (chosen by
the model, its cache row not yet written), and the cache holds rows for all tokens before it.
A step drafts a tree rooted at each request's pending token, verifies all requests' trees in one
batched forward, walks each tree greedily (`drafting.accept_greedy`), keeps the accepted nodes'
rows and appends the emitted tokens. With no drafter each tree is the pending token alone: plain
greedy decoding, one token per request per step, through the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..runtime.inputs import InputError
from .deepseek_v3 import DeepseekV3Verifier
from .drafting import DraftTree, accept_greedy

Drafter = Callable[[Sequence[int]], DraftTree]


@dataclass
class VerifyStep:
    """One verify step, as `speculative_decode` hands it to on_step.

    requests: indices into the prompts of the requests in this step's batch (B of them);
    contexts: each one's committed tokens before the step (what its cache rows hold);
    trees: each one's draft tree (node 0 its pending token); logits: [B, S, vocab] from the
    verifier (S the largest tree; a request's rows past its tree's size are padding);
    accepted: each one's accepted nodes; emitted: the tokens each one gained.
    """

    requests: list[int]
    contexts: list[list[int]]
    trees: list[DraftTree]
    logits: torch.Tensor
    accepted: list[list[int]]
    emitted: list[list[int]]


@dataclass
class DecodeResult:
    """tokens: each request's first max_new_tokens generated tokens; steps: verify steps run;
    emitted: per step, the tokens each request of the step gained (1 + accepted drafts)."""

    tokens: list[list[int]]
    steps: int = 0
    emitted: list[list[int]] = field(default_factory=list)


def no_draft(tokens: Sequence[int]) -> DraftTree:
    """The tree of the pending token alone: plain greedy decoding."""
    return DraftTree.chain([tokens[-1]])


@torch.no_grad()
def speculative_decode(verifier: DeepseekV3Verifier, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       drafter: Drafter = no_draft,
                       on_step: Callable[[VerifyStep], None] | None = None) -> DecodeResult:
    """Greedy speculative decoding of every prompt until each has max_new_tokens new tokens.

    prompts: token id lists (at least one token each); drafter: maps a request's tokens (its
    last one pending) to a `DraftTree` rooted at that token (`drafting.lookup_tree` drafts by
    prompt lookup; `no_draft` for plain greedy decoding); on_step: called after each verify step
    with its `VerifyStep`. Takes one request slot per prompt and releases them at the end.
    Returns a `DecodeResult`; with exact arithmetic its tokens are the model's greedy decoding.
    """
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens: got {max_new_tokens}, expected at least 1")
    slots: list[int] = []
    try:
        for _ in prompts:
            slots.append(verifier.add_request())
        first = verifier.prefill(slots, prompts).argmax(-1).tolist()
        texts = [list(map(int, p)) + [f] for p, f in zip(prompts, first, strict=True)]
        generated = [[f] for f in first]
        result = DecodeResult(tokens=generated)
        active = [b for b in range(len(prompts)) if len(generated[b]) < max_new_tokens]
        while active:
            trees = [drafter(texts[b]) for b in active]
            for b, tree in zip(active, trees, strict=True):
                if tree.tokens[0] != texts[b][-1]:
                    raise InputError(f"drafter: returned a tree rooted at token {tree.tokens[0]} for request {b}, "
                                     f"expected its pending token {texts[b][-1]}")
            contexts = [texts[b][:-1] for b in active] if on_step is not None else []
            logits = verifier.verify([slots[b] for b in active], trees)
            greedy = logits.argmax(-1).tolist()
            accepted, emitted = [], []
            for j, b in enumerate(active):
                nodes, tokens = accept_greedy(trees[j], greedy[j])
                verifier.accept(slots[b], nodes)
                texts[b] += tokens
                generated[b] += tokens
                accepted.append(nodes)
                emitted.append(tokens)
            result.steps += 1
            result.emitted.append([len(t) for t in emitted])
            if on_step is not None:
                on_step(VerifyStep(list(active), contexts, trees, logits, accepted, emitted))
            active = [b for b in active if len(generated[b]) < max_new_tokens]
        result.tokens = [g[:max_new_tokens] for g in generated]
        return result
    finally:
        for s in slots:
            verifier.release(s)

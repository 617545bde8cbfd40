"""GPU proofs of the DeepSeek-V3 integration (`mlagen.integrations`) with `mlagen.verify_attention`
in bf16, on Kimi K2's attention shapes (64 heads over one 512 + 64 latent head).

1. One layer's attention, for a batch of four requests with prefixes of 0 to 1500 tokens and a
   draft chain or tree: (a) the kernel's output and lse on the latent queries and paged rows the
   integration builds from the model's weights match mlagen's fp64 reference row by row at bf16's
   per-row tolerance (`mlagen.tools.testing.tolerance`); (b) the layer's output is as accurate,
   against the model's own DeepseekV3Attention in fp64, as that attention run in bf16, up to the
   kernel's per-row allowance. FP8 caches (e4m3, ds_mla) get check (a).
2. examples/speculative_decoding.py's decoding (prompt-lookup chains and trees, four requests,
   64 new tokens each): at every verify step the logits match the model's own bf16 forward over
   the same tokens within a stated bound, and every emitted token is the model's own greedy
   choice wherever its top-2 margin leaves no room for the bound to swap them.

    python -m pytest -q -n 0 tests/test_gpu_integration.py -s     # -s prints the measured figures
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from scripts import load_script

import mlagen
from mlagen.dsl.spec import MAX_SEQLEN_Q
from mlagen.integrations import (
    AbsorbedMLA,
    DeepseekV3Verifier,
    DraftTree,
    MlagenBackend,
    lookup_tree,
    model_logits,
    speculative_decode,
)
from mlagen.tools.testing import assert_rows_match, rel_error, tolerance

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers", reason="the DeepSeek-V3 integration tests need transformers")
BF16_EPS = torch.finfo(torch.bfloat16).eps            # 2^-7
DEVICE = "cuda"
KIMI_K2_ATTENTION = dict(num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512, q_lora_rank=1536,
                         qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
PREFIXES = [0, 37, 300, 1500]       # one request without a prefix, one past several 64-row pages
SEQLEN_Q = 9


@pytest.fixture(autouse=True)
def no_grad():
    """No autograd graph: the tests only run the models forward."""
    with torch.no_grad():
        yield


@functools.cache
def attention_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded 2-layer DeepSeek-V3 with Kimi K2's attention on the GPU: (fp64 copy, bf16 model)
    of the same bf16 weights, so the fp64 copy computes the bf16 model without rounding. Weights
    are drawn with std 0.06 (not the config's default 0.02) so that attention scores spread
    (std ~2, the largest weight of a row ~0.3 on average) as a trained model's do; with 0.02
    every row is nearly uniform."""
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
        n_shared_experts=1, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, initializer_range=0.06, attn_implementation="eager",
        experts_implementation="eager", **KIMI_K2_ATTENTION)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).to(device=DEVICE, dtype=torch.bfloat16).eval()
    return copy.deepcopy(model).double(), model


def draft_tree(mask: str, gen: torch.Generator) -> DraftTree:
    """A chain of SEQLEN_Q nodes, or a random tree (each node's parent drawn among the earlier ones)."""
    if mask == "chain":
        return DraftTree.chain(range(SEQLEN_Q))
    parents = [-1] + [int(torch.randint(0, k, (1,), generator=gen)) for k in range(1, SEQLEN_Q)]
    return DraftTree(tuple(range(SEQLEN_Q)), tuple(parents))


def own_attention(model: torch.nn.Module, layer: int, x: torch.Tensor, prefix: int, tree: DraftTree) -> torch.Tensor:
    """The model's own DeepseekV3Attention over x [prefix + S, hidden] (prefix causal, then the
    tree at depth-based positions, through a 4D additive mask): the tree rows' output [S, hidden]."""
    S = len(tree)
    positions = torch.tensor([list(range(prefix)) + [prefix + d for d in tree.depths()]], device=x.device)
    seen = torch.zeros(prefix + S, prefix + S, dtype=torch.bool)
    seen[:prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
    seen[prefix:, :prefix] = True
    seen[prefix:, prefix:] = tree.mask()
    mask = torch.zeros(seen.shape, dtype=x.dtype).masked_fill(~seen, torch.finfo(x.dtype).min)
    cos, sin = model.model.rotary_emb(x[None], positions)
    out = model.model.layers[layer].self_attn(hidden_states=x[None], position_embeddings=(cos, sin),
                                              attention_mask=mask[None, None].to(x.device))[0]
    return out[0, prefix:]


def filled_verifier(model: torch.nn.Module, layer: int, hidden: list[torch.Tensor], tree: DraftTree,
                    **kwargs: object) -> tuple[DeepseekV3Verifier, list[int], torch.Tensor, torch.Tensor]:
    """A verifier on the mlagen backend whose layer `layer` holds each request's prefix rows
    (written through `attention` in causal chunks of MAX_SEQLEN_Q, the requests' chunks taking
    turns so that their pages interleave): (verifier, slots, the draft's hidden states
    [B, S, hidden], their positions [B, S])."""
    verifier = DeepseekV3Verifier(model, backend=MlagenBackend(), page_size=64, max_requests=len(hidden),
                                  max_context=2048, **kwargs)
    slots = [verifier.add_request() for _ in hidden]
    for start in range(0, max(PREFIXES), MAX_SEQLEN_Q):
        for slot, p, x in zip(slots, PREFIXES, hidden, strict=True):
            end = min(p, start + MAX_SEQLEN_Q)
            if start < end:
                verifier.attention(layer, [slot], x[None, start:end], torch.arange(start, end)[None])
    draft = torch.stack([x[p:] for p, x in zip(PREFIXES, hidden, strict=True)])
    positions = torch.tensor([[p + d for d in tree.depths()] for p in PREFIXES])
    return verifier, slots, draft, positions


def kernel_rows_match(verifier: DeepseekV3Verifier, layer: int, slots: list[int], draft: torch.Tensor,
                      positions: torch.Tensor, tree_mask: torch.Tensor | None) -> None:
    """The op's out and lse on the integration's latent queries and its paged cache (tree rows
    included) against mlagen's fp64 reference of the same inputs, row by row at bf16's tolerance."""
    mla = verifier.mla[layer]
    cos, sin = verifier.model.model.rotary_emb(draft, positions.to(DEVICE))
    q, _ = mla.project(draft, cos, sin)
    cache = verifier.cache
    args = (q.contiguous(), cache.layer(layer), cache.block_table(slots), cache.seqlens(slots))
    kwargs = dict(softmax_scale=mla.scale, causal=True, tree_mask=tree_mask, head_dim_v=mla.latent,
                  kv_scale=cache.kv_scale(layer))
    out, lse = mlagen.verify_attention(*args, return_lse=True, **kwargs)
    ref_out, ref_lse = mlagen.reference(*args, dtype=torch.float64, **kwargs)
    assert_rows_match(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2), tolerance(torch.bfloat16))


@pytest.mark.parametrize("mask", ["chain", "tree"])
def test_attention_matches_the_models_own_attention(mask):
    exact, model = attention_models()
    gen = torch.Generator().manual_seed(3)
    tree = draft_tree(mask, gen)
    layer = 1
    hidden = [torch.randn(p + SEQLEN_Q, 1024, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
              for p in PREFIXES]
    verifier, slots, draft, positions = filled_verifier(model, layer, hidden, tree)
    tree_mask = None if mask == "chain" else tree.mask().repeat(len(slots), 1, 1).to(DEVICE)
    got = verifier.attention(layer, slots, draft, positions, tree_mask)           # [B, S, hidden] bf16

    # (a) the kernel on the model's own rows, at mlagen's per-row tolerance
    kernel_rows_match(verifier, layer, slots, draft, positions, tree_mask)

    # (b) the layer's output: no less accurate than the model's own bf16 attention, up to the
    # kernel's per-row allowance (both measured against the model's own attention in fp64).
    allowance = tolerance(torch.bfloat16).row_rel
    for b, (p, x) in enumerate(zip(PREFIXES, hidden, strict=True)):
        truth = own_attention(exact, layer, x.double(), p, tree)
        own = own_attention(model, layer, x, p, tree)
        ours, theirs = rel_error(got[b], truth), rel_error(own, truth)
        print(f"[{mask}] request {b} (prefix {p}): worst row's relative error against the fp64 model: "
              f"integration {ours:.3g}, the model's own bf16 attention {theirs:.3g} (bound {theirs + allowance:.3g})")
        assert ours <= theirs + allowance, (
            f"request {b} (prefix {p}, {mask}): the integration's worst row is {ours:.3g} off the fp64 model "
            f"attention (relative), the model's own bf16 attention {theirs:.3g}; bound {theirs:.3g} + {allowance:.3g}")


@pytest.mark.parametrize("kv_format", ["e4m3", "ds_mla"])
def test_fp8_caches_run_the_models_rows(kv_format):
    """The integration's rows in an FP8 cache: the kernel against the fp64 reference over the same
    FP8 cache, at bf16's per-row tolerance. The e4m3 scale is amax / 448 of the bf16 rows, rounded
    up to a power of two (so that dequantized values are exact in bf16)."""
    _, model = attention_models()
    gen = torch.Generator().manual_seed(4)
    tree = draft_tree("tree", gen)
    layer = 0
    hidden = [torch.randn(p + SEQLEN_Q, 1024, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
              for p in PREFIXES]
    scale = None
    if kv_format == "e4m3":
        mla = AbsorbedMLA(model.model.layers[layer].self_attn, model.config)
        amax = 0.0
        for p, x in zip(PREFIXES, hidden, strict=True):
            positions = torch.tensor([list(range(p)) + [p + d for d in tree.depths()]], device=DEVICE)
            _, rows = mla.project(x[None], *model.model.rotary_emb(x[None], positions))
            amax = max(amax, rows.float().abs().max().item())
        scale = 2.0 ** math.ceil(math.log2(amax / 448))
    verifier, slots, draft, positions = filled_verifier(model, layer, hidden, tree, kv_format=kv_format,
                                                        kv_scale=scale)
    tree_mask = tree.mask().repeat(len(slots), 1, 1).to(DEVICE)
    verifier.attention(layer, slots, draft, positions, tree_mask)
    kernel_rows_match(verifier, layer, slots, draft, positions, tree_mask)


def load_example():
    return load_script("examples/speculative_decoding.py")


@pytest.mark.parametrize("branches", [1, 4], ids=["chains", "trees"])
def test_speculative_decoding_matches_the_models_own_forward(branches):
    """The example's seeded model (Kimi K2 attention, 2 layers, hidden 1024, bf16) decoding four
    prompts by 64 tokens with prompt-lookup drafts.

    Logit bound per request and step: (1 + 2 L) x eps x max |logit| (eps = 2^-7, L = 2 layers,
    max over the model's own logits of the request's tree). Each side rounds its logits to bf16
    (up to eps / 2 relative each: eps together), and in each of the L layers the two attentions
    may differ by the kernel's per-row tolerance, 2 eps relative, which moves the residual stream
    and so the logits by about as much relative to their scale.

    Tokens: an emitted token is the greedy choice at an accepted node; it must equal the argmax
    of the model's own logits there wherever their top-2 margin exceeds twice that node's
    measured max |logit difference| d (at most the bound, as checked above): the top two can
    swap only when margin <= 2 d, so any disagreement past it is a wrong token, not rounding.
    With d typically a quarter of the bound, this checks more positions than margin > bound
    would, and never fails spuriously. Positions under the margin are counted and printed.

    Every expert is routed to (experts per token = experts): top-k routing with k < n jumps at
    ties between expert scores, where two correct bf16 computations could route a token to
    different experts and the logits would differ by the model's own discontinuity, not the
    attention's error.
    """
    example = load_example()
    args = example.parse_args(["--device", DEVICE, "--dtype", "bf16", "--batch", "4", "--new-tokens", "64",
                               "--layers", "2", "--hidden-size", "1024", "--experts", "4", "--experts-per-token", "4",
                               "--branches", str(branches)])
    model = example.build_model(args)
    prompts = example.make_prompts(args, model.config.vocab_size)
    layers = model.config.num_hidden_layers
    verifier = DeepseekV3Verifier(model, backend=MlagenBackend(), page_size=args.page_size, max_requests=args.batch,
                                  max_context=512)
    factor = (1 + 2 * layers) * BF16_EPS
    figures = {"worst": 0.0, "worst_over_bound": 0.0, "checked": 0, "under_margin": 0, "trees": 0, "nodes": 0}
    failures: list[str] = []

    def check(step) -> None:
        for j, request in enumerate(step.requests):
            tree = step.trees[j]
            ref = model_logits(model, step.contexts[j], tree).float()
            got = step.logits[j, : len(tree)].float()
            bound = factor * ref.abs().max().item()
            diff = (got - ref).abs().max().item()
            figures["worst"] = max(figures["worst"], diff)
            figures["worst_over_bound"] = max(figures["worst_over_bound"], diff / bound)
            figures["trees"] += not tree.is_chain
            figures["nodes"] += len(tree)
            if diff > bound:
                failures.append(f"step {step_no[0]}, request {request}: max |logit - model's| = "
                                f"{diff:.4g} > bound {bound:.4g} (tree of {len(tree)} nodes, context "
                                f"{len(step.contexts[j])} tokens)")
            top = ref.topk(2, dim=-1)
            margin = (top.values[:, 0] - top.values[:, 1]).tolist()
            choice = top.indices[:, 0].tolist()
            row_diff = (got - ref).abs().amax(dim=-1).tolist()
            for node, token in zip(step.accepted[j], step.emitted[j], strict=True):
                if margin[node] <= 2 * row_diff[node]:
                    figures["under_margin"] += 1
                    continue
                figures["checked"] += 1
                if token != choice[node]:
                    failures.append(f"step {step_no[0]}, request {request}, node {node}: emitted token {token}, the "
                                    f"model's greedy choice {choice[node]} (margin {margin[node]:.4g} > 2 x the "
                                    f"row's max |logit diff| {row_diff[node]:.4g})")
        step_no[0] += 1

    step_no = [1]
    drafter = functools.partial(lookup_tree, draft_len=args.draft_len, branches=branches)
    result = speculative_decode(verifier, prompts, args.new_tokens, drafter=drafter, on_step=check)
    emitted = sum(map(sum, result.emitted))
    print(f"[{branches} branches] {result.steps} verify steps, {emitted / sum(map(len, result.emitted)):.2f} tokens "
          f"per request-step, {figures['nodes']} draft nodes ({figures['trees']} non-chain trees); max |logit diff| "
          f"{figures['worst']:.4g} = {figures['worst_over_bound']:.3f} x the bound ((1 + 2 x {layers}) eps x "
          f"max |logit|); emitted tokens checked against the model's greedy choice: {figures['checked']}, under "
          f"the 2 x |logit diff| margin (not checked): {figures['under_margin']}")
    assert not failures, f"{len(failures)} disagreements; first ones:\n" + "\n".join(failures[:10])
    assert all(len(t) == args.new_tokens for t in result.tokens)
    assert emitted > sum(map(len, result.emitted)), "no draft was ever accepted: the drafts went unexercised"
    if branches > 1:
        assert figures["trees"] > 0, "every draft was a chain: the tree masks went unexercised"

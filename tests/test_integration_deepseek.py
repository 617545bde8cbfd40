"""mlagen.integrations on the CPU: transformers' DeepSeek-V3 with its attention run as absorbed MLA
over the paged latent cache through `mlagen.reference`.

The proofs, on tiny seeded models in fp64: one layer's attention through the integration equals
the model's own `DeepseekV3Attention` forward (its original, unabsorbed weights) for causal chains
and draft trees over a batch with different prefix lengths; the verify step's logits equal the
model's own forward over the same tokens, and speculative decoding emits the model's greedy
tokens. Then the paged cache (append, keep, truncate, block tables, FP8 rows), prompt-lookup
drafting, the greedy tree walk, argument errors and examples/speculative_decoding.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the DeepSeek-V3 integration tests need transformers "
                                                          "(pip install transformers)")

from scripts import load_script  # noqa: E402

from mlagen import InputError, quantize_kv  # noqa: E402
from mlagen.dsl.spec import MAX_SEQLEN_Q  # noqa: E402
from mlagen.integrations import (  # noqa: E402
    PAD_TOKEN,
    DeepseekV3Verifier,
    DraftTree,
    MlagenBackend,
    PagedLatentCache,
    ReferenceBackend,
    accept_greedy,
    check_model,
    lookup_tree,
    model_logits,
    no_draft,
    prompt_lookup,
    speculative_decode,
)

# fp64 everywhere, but the model's RMSNorms round their normalized values to fp32 (unit roundoff
# 2^-24 = 6e-8) and its router scores in fp32: a matmul that sums in another order (the batch
# shapes differ) can flip one such rounding, so both sides agree to a few fp32 ulps (measured:
# 4e-8 of the output scale in attention, 1e-7 in logits), not to fp64's. A wrong rope, scale,
# mask or weight split is off by 1e-2 or more.
ATTENTION_RTOL = 1e-6           # max |integration - model| / max |model|, one layer's attention
LOGITS_RTOL = 1e-5              # the same over logits: two layers, the MoE's routing weights


@functools.cache
def tiny_model(interleave: bool = True, q_lora: bool = True, heads: int = 4, latent: int = 32, rope: int = 16,
               vocab: int = 96) -> torch.nn.Module:
    """A seeded 2-layer DeepSeek-V3 (layer 0 dense, layer 1 MoE) in fp64, with yarn rope whose
    mscale differs from mscale_all_dim (so cos/sin carry an attention factor and the softmax
    scale an mscale^2)."""
    config = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=4, n_group=1,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=latent,
        q_lora_rank=48 if q_lora else None, qk_rope_head_dim=rope, qk_nope_head_dim=24, v_head_dim=20,
        max_position_embeddings=512, initializer_range=0.1, rope_interleave=interleave,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.7, "original_max_position_embeddings": 128, "beta_fast": 32,
                         "beta_slow": 1},
        attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).double().eval()


def ancestors(parents: list[int]) -> torch.Tensor:
    """Bool [S, S]: node k is node i or an ancestor of it (written here apart from DraftTree.mask)."""
    S = len(parents)
    seen = torch.zeros(S, S, dtype=torch.bool)
    for i in range(S):
        k = i
        while k >= 0:
            seen[i, k] = True
            k = parents[k]
    return seen


def additive_mask(prefix: int, parents: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The model's 4D additive mask [1, 1, T, T] for `prefix` causal tokens then a draft tree."""
    S = len(parents)
    seen = torch.zeros(prefix + S, prefix + S, dtype=torch.bool)
    seen[:prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
    seen[prefix:, :prefix] = True
    seen[prefix:, prefix:] = ancestors(parents)
    return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)[None, None]


def depths_of(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def scrambled(verifier: DeepseekV3Verifier) -> DeepseekV3Verifier:
    """The verifier with its free page list shuffled by a request that takes pages and goes, so
    that requests' pages are not in order."""
    slots = [verifier.add_request() for _ in range(3)]
    for s in slots:
        verifier.cache.append([s], 9)
    verifier.release(slots[1])
    verifier.release(slots[0])
    verifier.release(slots[2])
    return verifier


@pytest.mark.parametrize("mask, interleave, q_lora", [("chain", True, True), ("tree", True, True),
                                                      ("tree", False, False)])
def test_attention_equals_the_models_own_attention(mask, interleave, q_lora):
    """Layer 1's attention through the integration (absorbed weights, latent paged cache,
    mlagen.reference) equals the model's DeepseekV3Attention with its own weights and the 4D
    mask, for a batch of three requests with prefixes of 0, 5 and 13 tokens and 6 draft tokens."""
    model = tiny_model(interleave, q_lora)
    verifier = scrambled(DeepseekV3Verifier(model, backend=ReferenceBackend(), page_size=4, max_requests=4,
                                            max_context=64))
    gen = torch.Generator().manual_seed(1)
    prefixes, S, layer = [0, 5, 13], 6, 1
    parents = [[k - 1 for k in range(S)] if mask == "chain" else
               [-1] + [int(torch.randint(0, k, (1,), generator=gen)) for k in range(1, S)] for _ in prefixes]
    hidden = [torch.randn(p + S, 64, generator=gen, dtype=torch.float64) for p in prefixes]
    slots = [verifier.add_request() for _ in prefixes]
    for slot, p, x in zip(slots, prefixes, hidden, strict=True):
        if p:
            verifier.attention(layer, [slot], x[None, :p], torch.arange(p)[None])
    draft = torch.stack([x[p:] for p, x in zip(prefixes, hidden, strict=True)])
    positions = torch.tensor([[p + d for d in depths_of(par)] for p, par in zip(prefixes, parents, strict=True)])
    tree_mask = None if mask == "chain" else torch.stack([ancestors(par) for par in parents])
    got = verifier.attention(layer, slots, draft, positions, tree_mask)

    attn = model.model.layers[layer].self_attn
    for b, (p, x, par) in enumerate(zip(prefixes, hidden, parents, strict=True)):
        pos = torch.tensor([list(range(p)) + [p + d for d in depths_of(par)]])
        cos, sin = model.model.rotary_emb(x[None], pos)
        expected = attn(hidden_states=x[None], position_embeddings=(cos, sin),
                        attention_mask=additive_mask(p, par, x.dtype))[0][0, p:]
        err = (got[b] - expected).abs().max().item()
        assert err <= ATTENTION_RTOL * expected.abs().max().item(), (
            f"request {b} (prefix {p}, {mask}): max |integration - model| = {err:.3g}, scale "
            f"{expected.abs().max().item():.3g}")
    assert verifier.cache.seqlens(slots).tolist() == [p + S for p in prefixes]


def test_verify_logits_equal_the_models_forward():
    """Prefill (one prompt longer than MAX_SEQLEN_Q, so chunked), a batch of chains, the accepted
    rows kept, then a batch of trees: every logit row equals the model's own forward over the
    same tokens (context, then the tree at depth-based positions)."""
    model = tiny_model()
    verifier = scrambled(DeepseekV3Verifier(model, backend=ReferenceBackend(), page_size=8, max_requests=4,
                                            max_context=160))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (MAX_SEQLEN_Q + 6, 3, 17)]
    slots = [verifier.add_request() for _ in prompts]
    last = verifier.prefill(slots, prompts)
    for b, p in enumerate(prompts):
        expected = model_logits(model, p[:-1], DraftTree.chain(p[-1:]))[0]
        torch.testing.assert_close(last[b], expected, rtol=0, atol=LOGITS_RTOL * expected.abs().max().item())

    contexts = [list(p) for p in prompts]
    chains = [DraftTree.chain([5, 6, 7, 8]), DraftTree.chain([9]), DraftTree.chain([1, 2, 3])]
    trees = [DraftTree.from_paths(4, [[1, 2, 3], [1, 5], [7]]), DraftTree.chain([2, 2]),
             DraftTree.from_paths(9, [[3], [4, 4, 4, 4], [5, 6]])]
    for round_, drafts in enumerate((chains, trees)):
        logits = verifier.verify(slots, drafts)
        assert logits.shape == (3, max(map(len, drafts)), 96)
        for b, tree in enumerate(drafts):
            expected = model_logits(model, contexts[b], tree)
            err = (logits[b, : len(tree)] - expected).abs().max().item()
            assert err <= LOGITS_RTOL * expected.abs().max().item(), (round_, b, err)
        # keep a path of each tree: node 0, then the first child chain
        for b, (slot, tree) in enumerate(zip(slots, drafts, strict=True)):
            path = [0] + [k for k in range(1, len(tree)) if tree.parents[k] == k - 1 and k <= 2]
            verifier.accept(slot, path)
            contexts[b] += [tree.tokens[k] for k in path]
        assert [verifier.cache.length(s) for s in slots] == [len(c) for c in contexts]


def test_speculative_decoding_emits_the_models_greedy_tokens():
    """Chains and trees by prompt lookup: at every step the verifier's logits equal the model's own
    forward, and the emitted tokens equal greedy decoding by the model's own full forward."""
    model = tiny_model()
    prompts = [[3, 4, 5, 6, 7, 3, 4, 5], [10, 11, 12, 10, 11], [20]]
    expected = []
    for p in prompts:
        ids = list(p)
        for _ in range(10):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        expected.append(ids[len(p):])
    worst = []

    def check(step):
        for j, tree in enumerate(step.trees):
            ref = model_logits(model, step.contexts[j], tree)
            worst.append((step.logits[j, : len(tree)] - ref).abs().max().item() / ref.abs().max().item())

    verifier = DeepseekV3Verifier(model, backend=ReferenceBackend(), page_size=4, max_requests=3, max_context=64)
    for drafter in (no_draft, functools.partial(lookup_tree, draft_len=4),
                    functools.partial(lookup_tree, draft_len=4, branches=3)):
        result = speculative_decode(verifier, prompts, 10, drafter=drafter,
                                    on_step=None if drafter is no_draft else check)
        assert result.tokens == expected, drafter
        if drafter is not no_draft:
            assert result.steps < 10 and max(max(e) for e in result.emitted) > 1, result.emitted
    assert max(worst) <= LOGITS_RTOL
    assert verifier.cache.free_pages == verifier.cache.pages.shape[1]      # every slot released


@pytest.mark.parametrize("kv_format", ["ds_mla", "e4m3"])
def test_fp8_cache_holds_quantize_kv_rows(kv_format):
    """With 512 + 64 rows, an FP8 cache holds exactly `mlagen.quantize_kv` of the rows an fp64 cache
    holds (layer 0, whose input does not depend on the cache), and its logits stay near the
    unquantized ones (e4m3 keeps 3 mantissa bits)."""
    model = tiny_model(heads=2, latent=512, rope=64)
    exact = DeepseekV3Verifier(model, backend=ReferenceBackend(), page_size=4, max_requests=1, max_context=32)
    scale = 0.05 if kv_format == "e4m3" else None
    fp8 = DeepseekV3Verifier(model, backend=ReferenceBackend(), page_size=4, max_requests=1, max_context=32,
                             kv_format=kv_format, kv_scale=scale)
    prompt = [5, 9, 2, 7, 7, 1, 3]
    logits = [v.prefill([v.add_request()], [prompt]) for v in (exact, fp8)]
    rows = exact.cache.rows(0, 0).float()
    expected, _ = quantize_kv(rows[:, None], kv_format, scale)
    got = fp8.cache.rows(0, 0)
    assert got.dtype == expected.dtype and torch.equal(got.view(torch.uint8), expected[:, 0].view(torch.uint8))
    err = (logits[1] - logits[0]).abs().max().item()
    assert 0 < err <= 0.1 * logits[0].abs().max().item()


def test_paged_cache_append_keep_truncate():
    cache = PagedLatentCache(num_layers=2, num_pages=6, page_size=4, max_requests=3, max_pages=3, latent_dim=6,
                             rope_dim=2, dtype=torch.float64)
    a, b = cache.add_request(), cache.add_request()
    ia = cache.append([a], 5)                         # a: pages 0, 1
    ib = cache.append([b], 2)                         # b: page 2
    i2 = cache.append([a, b], 3)                      # a: 8 rows (pages 0, 1), b: 5 rows (pages 2, 3)
    assert cache.pages_of(a) == [0, 1] and cache.pages_of(b) == [2, 3]
    assert cache.block_table([b, a]).tolist() == [[2, 3, 0], [0, 1, 0]]
    assert cache.seqlens([a, b]).tolist() == [8, 5] and cache.block_table([a]).dtype == torch.int32
    assert i2.start == (5, 2) and i2.page.tolist() == [[1, 1, 1], [2, 2, 3]] and i2.offset.tolist() == [[1, 2, 3],
                                                                                                       [2, 3, 0]]
    value = {a: torch.arange(8.0)[:, None].expand(8, 8), b: 100 + torch.arange(5.0)[:, None].expand(5, 8)}
    for layer in range(2):
        cache.write(layer, ia, (value[a][None, :5] + 1000 * layer))
        cache.write(layer, ib, (value[b][None, :2] + 1000 * layer))
        cache.write(layer, i2, torch.stack([value[a][5:], value[b][2:]]) + 1000 * layer)
    for layer in range(2):
        assert torch.equal(cache.rows(layer, a), value[a] + 1000 * layer)
        assert torch.equal(cache.rows(layer, b), value[b] + 1000 * layer)
    # keep draft rows 0, 2, 4 of b's last five (a tree path) as its rows 0..2: in every layer
    cache.keep(b, 0, [0, 2, 4])
    for layer in range(2):
        assert cache.rows(layer, b)[:, 0].tolist() == [100 + 1000 * layer, 102 + 1000 * layer, 104 + 1000 * layer]
    assert cache.length(b) == 3 and cache.pages_of(b) == [2] and cache.free_pages == 3
    cache.truncate(a, 4)
    assert cache.pages_of(a) == [0] and cache.free_pages == 4
    assert cache.rows(1, a)[:, 0].tolist() == [1000.0, 1001.0, 1002.0, 1003.0]
    with pytest.raises(InputError, match="max_pages"):
        cache.append([a], 13)                          # 17 rows > 3 pages x 4
    with pytest.raises(InputError, match="num_pages"):
        c = cache.add_request()
        cache.append([c], 12)                           # 3 pages, 2 after a's and b's... the pool has 4: fits
        cache.append([a, b], 8)                         # needs 4 more, 1 left
    assert cache.length(a) == 4 and cache.length(b) == 3   # a refused append changes nothing
    with pytest.raises(InputError, match="kept"):
        cache.keep(a, 0, [0, 0])
    with pytest.raises(InputError, match="slot"):
        cache.length(2 + 5)
    cache.release(a)
    with pytest.raises(InputError, match="slot"):
        cache.append([a], 1)


def test_prompt_lookup_and_tree_building():
    text = [1, 2, 3, 9, 1, 2, 4, 5, 7, 1, 2]
    # [7, 1, 2] occurs nowhere before; [1, 2] at 4 and 0 (most recent first); [2] at the same places
    assert prompt_lookup(text, max_ngram=3, draft_len=3, max_candidates=3) == [[4, 5, 7], [3, 9, 1]]
    assert prompt_lookup(text[:-1], max_ngram=1, draft_len=2, max_candidates=3) == [[2, 4], [2, 3]]
    assert prompt_lookup(text, draft_len=2) == [[4, 5]]
    assert prompt_lookup([1, 2, 3], draft_len=2) == []
    tree = DraftTree.from_paths(2, [[4, 5, 7], [4, 6], [3]])
    assert tree.tokens == (2, 4, 5, 7, 6, 3) and tree.parents == (-1, 0, 1, 2, 1, 0)
    assert tree.depths() == [0, 1, 2, 3, 2, 1] and not tree.is_chain
    assert torch.equal(tree.mask(), ancestors(list(tree.parents)))
    assert DraftTree.from_paths(2, [[4, 5, 7], [4, 6]], max_nodes=3).tokens == (2, 4, 5)
    chain = lookup_tree(text, draft_len=3)
    assert chain.tokens == (2, 4, 5, 7) and chain.is_chain
    assert lookup_tree(text, draft_len=3, branches=2).tokens == (2, 4, 5, 7, 3, 9, 1)
    padded = tree.padded(8)
    assert padded.tokens[6:] == (PAD_TOKEN, PAD_TOKEN) and padded.parents[6:] == (5, 6)
    assert not padded.mask()[:6, 6:].any()                          # no real node sees padding
    with pytest.raises(ValueError, match="parents"):
        DraftTree((1, 2), (-1, 1))


def test_greedy_walk_through_a_tree():
    tree = DraftTree.from_paths(2, [[4, 5, 7], [4, 6], [3]])     # nodes: 2 | 4 5 7 | 6 | 3
    greedy = {0: 4, 1: 6, 4: 8}                                  # 2 -> 4 -> 6, then 8 is not drafted
    nodes, emitted = accept_greedy(tree, [greedy.get(k, 0) for k in range(len(tree))])
    assert nodes == [0, 1, 4] and emitted == [4, 6, 8]
    assert accept_greedy(tree, [9] * len(tree)) == ([0], [9])          # nothing accepted: one token
    full = accept_greedy(DraftTree.chain([1, 2, 3]), [2, 3, 4])
    assert full == ([0, 1, 2], [2, 3, 4])
    padded = DraftTree.chain([1]).padded(3)                              # padding is never reached
    assert accept_greedy(padded, [0, 0, 0]) == ([0], [0])


def test_clear_errors():
    with pytest.raises(ValueError, match="model: got a Linear"):
        check_model(torch.nn.Linear(2, 2))
    model = tiny_model()
    with pytest.raises(InputError, match="model: got torch.float64"):
        DeepseekV3Verifier(model, backend=MlagenBackend())
    verifier = DeepseekV3Verifier(model, backend=ReferenceBackend(), page_size=4, max_requests=1, max_context=128)
    slot = verifier.add_request()
    with pytest.raises(InputError, match=f"expected at most {MAX_SEQLEN_Q}"):
        verifier.verify([slot], [DraftTree.chain(range(MAX_SEQLEN_Q + 1))])
    with pytest.raises(InputError, match=r"tokens.shape\[1\]"):
        verifier.forward([slot], torch.zeros(1, MAX_SEQLEN_Q + 1, dtype=torch.long),
                         torch.zeros(1, MAX_SEQLEN_Q + 1, dtype=torch.long))
    with pytest.raises(InputError, match="slot"):
        verifier.accept(slot, [0])
    verifier.verify([slot], [DraftTree.from_paths(1, [[2, 3], [4]])])      # nodes 1 | 2 3 | 4
    with pytest.raises(InputError, match="nodes"):
        verifier.accept(slot, [0, 1, 3])                                    # node 3's parent is 0
    verifier.accept(slot, [0, 3])
    assert verifier.cache.length(slot) == 2
    with pytest.raises(InputError, match="max_requests"):
        verifier.add_request()
    with pytest.raises(InputError, match="drafter"):
        verifier.release(slot)
        speculative_decode(verifier, [[1, 2]], 4, drafter=lambda tokens: DraftTree.chain([tokens[-1] + 1]))
    with pytest.raises(InputError, match="kv_format"):
        DeepseekV3Verifier(model, backend=ReferenceBackend(), kv_format="ds_mla")     # 32 + 16-wide rows


def _example():
    return load_script("examples/speculative_decoding.py")


EXAMPLE_ARGS = ["--device", "cpu", "--dtype", "fp64", "--new-tokens", "6", "--batch", "2", "--hidden-size", "64",
                "--vocab", "128", "--prompt-len", "20", "--draft-len", "4"]


def test_example_runs_on_the_cpu(capsys):
    example = _example()
    results = example.main(EXAMPLE_ARGS)
    out = capsys.readouterr().out
    assert set(results) == {"greedy", "chain", "tree"}
    for name in ("chain", "tree"):
        assert results[name].tokens == results["greedy"].tokens, name
        assert f"{name}: " in out and "x greedy" in out and "% of the time" in out
    assert all(len(t) == 6 for t in results["greedy"].tokens) and results["greedy"].steps == 5
    assert "64 heads, latent 512 + rope 64" in out and "accepted drafts per request" in out
    assert "parts from greedy" not in out                  # fp64: every mode decodes greedy's text


def test_example_names_where_a_text_parts_from_greedy():
    """first_difference finds the first differing token and reports the model's own top-2 there:
    in fp64 its top-1 is greedy's token."""
    example = _example()
    args = example.parse_args(EXAMPLE_ARGS)
    model = example.build_model(args)
    prompt = example.make_prompts(args, model.config.vocab_size)[0]
    greedy = example.main(EXAMPLE_ARGS)["greedy"].tokens[0]
    assert example.first_difference(model, prompt, greedy, greedy) is None
    other = greedy[:3] + [(greedy[3] + 1) % model.config.vocab_size] + greedy[4:]
    where = example.first_difference(model, prompt, other, greedy)
    assert where.startswith(f"new token 3: this run {other[3]}, greedy {greedy[3]}; the model's own top-2 there: "
                            f"{greedy[3]} at "), where

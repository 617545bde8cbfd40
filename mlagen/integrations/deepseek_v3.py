"""Hugging Face transformers' DeepSeek-V3 (and Kimi K2, the same architecture) with its attention
run as absorbed MLA over a paged latent cache, through mlagen.

`DeepseekV3Verifier` wraps a `transformers.DeepseekV3ForCausalLM` and runs the model's own
embedding, norms, MLP/MoE layers and head; only the attention is replaced. Per layer
(`AbsorbedMLA`), with H heads, nope = qk_nope_head_dim, rope = qk_rope_head_dim and
Dl = kv_lora_rank:

- the query: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x)) per head split into q_nope
  [nope] and q_pe [rope]; the latent query row is [q_nope @ W_UK (Dl), rope(q_pe) (rope)];
- the cache row: kv_a_proj_with_mqa(x) split into c_kv [Dl] and k_pe [rope]; the row is
  [kv_a_layernorm(c_kv) (Dl), rope(k_pe) (rope)], one latent "head" shared by all H;
- W_UK, W_UV: the two halves of kv_b_proj's weight per head ([H, nope, Dl] and [H, v, Dl]), so
  k_nope = W_UK c and v = W_UV c; attention over the latent rows gives [H, Dl] per token, and
  head h's output is that times W_UV[h]^T, then o_proj;
- rope is the model's: cos and sin from its rotary embedding (with yarn's attention factor, as
  the model has it) at each token's position, applied to (x[2i], x[2i+1]) pairs when the config
  sets rope_interleave (DeepSeek's checkpoints do) and to (x[i], x[i + rope/2]) otherwise,
  writing the rotated pairs' first members then their second members, as the model does;
- the softmax scale is the attention module's `scaling` (qk_head_dim^-0.5, times mscale^2 under
  yarn).

A verify step takes one `DraftTree` per request: its S nodes go in as S query tokens at
positions (cache length + node depth), their rows are appended to the cache, and attention runs
with the causal mask for chains, the trees' ancestor masks otherwise. After acceptance,
`accept` keeps the accepted nodes' rows and drops the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dsl.spec import MAX_SEQLEN_Q
from ..runtime.inputs import InputError
from .backends import AttentionBackend, MlagenBackend, default_backend
from .drafting import DraftTree
from .paged_cache import PagedLatentCache, RowIndex

ATTENTION_MODULES = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
CONFIG_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_attention_heads",
                 "num_hidden_layers", "rope_interleave")
MLAGEN_DTYPES = (torch.bfloat16, torch.float16)
FLOAT_WEIGHTS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_model(model: object) -> None:
    """Raises ValueError naming `model` unless it is a DeepSeek-V3-style causal LM: a config with
    MLA's fields, `model.model.embed_tokens`, `.layers` (each with `self_attn` holding the MLA
    projections, `input_layernorm`, `post_attention_layernorm`, `mlp`), `.norm`,
    `.rotary_emb` and `model.lm_head`."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    expected = "a transformers DeepseekV3ForCausalLM (or a model of the same architecture, e.g. Kimi K2)"
    if config is None or inner is None or not hasattr(model, "lm_head"):
        raise ValueError(f"model: got a {type(model).__name__}, expected {expected}")
    missing = [f for f in CONFIG_FIELDS if getattr(config, f, None) is None]
    if missing:
        raise ValueError(f"model: got a {type(model).__name__} whose config lacks {', '.join(missing)}, "
                         f"expected {expected} (config model_type {getattr(config, 'model_type', None)!r})")
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            raise ValueError(f"model: got a {type(model).__name__} without model.{name}, expected {expected}")
    for i, layer in enumerate(inner.layers[: config.num_hidden_layers]):
        attn = getattr(layer, "self_attn", None)
        absent = [m for m in ATTENTION_MODULES if getattr(attn, m, None) is None]
        if getattr(attn, "q_proj", None) is None and getattr(attn, "q_b_proj", None) is None:
            absent.append("q_proj or q_b_proj")
        if attn is None or absent or not hasattr(attn, "scaling"):
            raise ValueError(f"model: layer {i}'s self_attn lacks {', '.join(absent) or 'scaling'}, expected "
                             f"DeepSeek-V3's MLA attention")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary embedding of x [..., rope] with cos, sin [..., rope] broadcastable to it (the
    model's rotary embedding output: its first half holds each pair's angle). interleave: pairs
    are (x[2i], x[2i+1]), else (x[i], x[i + rope/2]); either way the result holds each pair's
    first rotated member, then each pair's second."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


class AbsorbedMLA:
    """One layer's MLA attention with kv_b_proj absorbed: the layer's own modules build the
    latent query and cache rows; W_UK and W_UV are views of kv_b_proj's weight (so build this
    after the model is on its final device and dtype)."""

    def __init__(self, attn: torch.nn.Module, config: object) -> None:
        self.attn = attn
        self.heads = int(config.num_attention_heads)
        self.nope, self.rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.latent, self.v_dim = int(config.kv_lora_rank), int(config.v_head_dim)
        self.interleave = bool(config.rope_interleave)
        self.scale = float(attn.scaling)
        weight = attn.kv_b_proj.weight.detach()
        if weight.dtype not in FLOAT_WEIGHTS or tuple(weight.shape) != (self.heads * (self.nope + self.v_dim),
                                                                         self.latent):
            raise ValueError(f"model: kv_b_proj.weight is {weight.dtype} {tuple(weight.shape)}, expected a plain "
                             f"{self.heads * (self.nope + self.v_dim)} x {self.latent} float weight to absorb "
                             "(load quantized checkpoints dequantized, e.g. with dtype=torch.bfloat16)")
        weight = weight.view(self.heads, self.nope + self.v_dim, self.latent)
        self.w_uk = weight[:, : self.nope]                     # [H, nope, Dl]: k_nope = W_UK c
        self.w_uv = weight[:, self.nope:]                      # [H, v, Dl]: v = W_UV c

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent queries and cache rows of x [B, S, hidden] (after input_layernorm), with cos and
        sin [B, S, rope] at the tokens' positions. Returns q [B, S, H, Dl + rope] and rows
        [B, S, Dl + rope], in x's dtype."""
        B, S, _ = x.shape
        attn = self.attn
        q = attn.q_proj(x) if getattr(attn, "q_proj", None) is not None else attn.q_b_proj(
            attn.q_a_layernorm(attn.q_a_proj(x)))
        q_nope, q_pe = q.view(B, S, self.heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = attn.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        c_kv = attn.kv_a_layernorm(c_kv)
        q_pe = apply_rope(q_pe, cos[:, :, None], sin[:, :, None], self.interleave)
        k_pe = apply_rope(k_pe, cos, sin, self.interleave)
        q_latent = torch.einsum("bshn,hnc->bshc", q_nope, self.w_uk)
        return torch.cat((q_latent, q_pe), dim=-1), torch.cat((c_kv, k_pe), dim=-1)

    def output(self, latent: torch.Tensor) -> torch.Tensor:
        """The attention output [B, S, hidden] of the latent attention result [B, S, H, Dl]:
        each head's result times W_UV^T, heads concatenated, then o_proj."""
        B, S = latent.shape[:2]
        values = torch.einsum("bshc,hvc->bshv", latent, self.w_uv)
        return self.attn.o_proj(values.reshape(B, S, self.heads * self.v_dim))


class DeepseekV3Verifier:
    """A DeepSeek-V3 causal LM whose attention runs as absorbed MLA over a `PagedLatentCache`.

    Args:
        model: a `transformers.DeepseekV3ForCausalLM` (on its final device and dtype; eval mode).
        backend: an `AttentionBackend`; default `MlagenBackend` on CUDA, `ReferenceBackend` elsewhere.
        page_size: rows per cache page; max_requests: request slots; max_context: rows one
            request may hold (the block table is ceil(max_context / page_size) pages wide);
            num_pages: the pool (default: every slot at max_context).
        kv_format: None (cache rows in the model's dtype), "e4m3" or "ds_mla" (FP8, 576-wide rows).
        kv_scale: the e4m3 scale (a float, or one per layer; None for 1.0); None for other formats.

    Raises ValueError naming `model` for a model of another architecture, and InputError for a
    dtype that the backend cannot take (`mlagen.verify_attention`: bf16 or fp16).
    """

    def __init__(self, model: torch.nn.Module, *, backend: AttentionBackend | None = None, page_size: int = 64,
                 max_requests: int = 8, max_context: int = 4096, num_pages: int | None = None,
                 kv_format: str | None = None, kv_scale: float | Sequence[float] | None = None) -> None:
        check_model(model)
        for name, value in (("page_size", page_size), ("max_requests", max_requests), ("max_context", max_context)):
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name}: got {value!r}, expected an int >= 1")
        self.model = model
        self.config = model.config
        inner = model.model
        self.layers = list(inner.layers[: self.config.num_hidden_layers])
        weight = inner.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.backend = backend if backend is not None else default_backend(self.device)
        if isinstance(self.backend, MlagenBackend) and self.dtype not in MLAGEN_DTYPES:
            raise InputError(f"model: got {self.dtype} weights, expected torch.bfloat16 or torch.float16 for the "
                             "mlagen backend (model.to(torch.bfloat16)), or backend=ReferenceBackend()")
        self.mla = [AbsorbedMLA(layer.self_attn, self.config) for layer in self.layers]
        max_pages = -(-max_context // page_size)
        self.cache = PagedLatentCache(
            num_layers=len(self.layers), num_pages=num_pages or max_requests * max_pages, page_size=page_size,
            max_requests=max_requests, max_pages=max_pages, latent_dim=int(self.config.kv_lora_rank),
            rope_dim=int(self.config.qk_rope_head_dim), dtype=self.dtype, kv_format=kv_format,
            kv_scale=kv_scale, device=self.device)
        self._drafts: dict[int, tuple[int, DraftTree]] = {}   # slot -> (draft's first row, tree)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self) -> int:
        """A new empty request slot (`PagedLatentCache.add_request`)."""
        return self.cache.add_request()

    def release(self, slot: int) -> None:
        """Frees a request slot and its pages."""
        self._drafts.pop(slot, None)
        self.cache.release(slot)

    # -- the model --------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, slots: Sequence[int], tokens: torch.Tensor, positions: torch.Tensor,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Runs S new tokens per request through the model and appends their rows to the cache.

        slots: B request slots; tokens: [B, S] int64 token ids; positions: [B, S] int64 rope
        positions; tree_mask: None (causal: token i sees the request's cache and new tokens
        0..i) or bool [B, S, S] (token i sees new token k where tree_mask[b, i, k]; the cache
        always). S <= `mlagen.dsl.spec.MAX_SEQLEN_Q`. Returns logits [B, S, vocab] in the model's
        dtype. Each request's length grows by S.
        """
        B = len(slots)
        if tokens.dim() != 2 or tokens.shape[0] != B:
            raise InputError(f"tokens.shape: got {tuple(tokens.shape)}, expected [B={B}, S]")
        S = tokens.shape[1]
        if not 1 <= S <= MAX_SEQLEN_Q:
            raise InputError(f"tokens.shape[1]: got {S} new tokens per request, expected 1..{MAX_SEQLEN_Q} "
                             "(prefill longer prompts in chunks: `prefill`)")
        if tuple(positions.shape) != (B, S):
            raise InputError(f"positions.shape: got {tuple(positions.shape)}, expected [{B}, {S}]")
        mask = self._tree_mask(tree_mask, B, S)
        index = self.cache.append(slots, S)
        inner = self.model.model
        h = inner.embed_tokens(tokens.to(self.device))
        cos, sin = inner.rotary_emb(h, positions.to(self.device))
        table, seqlens = self.cache.block_table(slots), self.cache.seqlens(slots)
        longest = max(self.cache.length(s) for s in slots)
        for i, layer in enumerate(self.layers):
            h = h + self._attend(i, layer.input_layernorm(h), cos, sin, index, table, seqlens, mask, longest)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h))

    @torch.no_grad()
    def attention(self, layer: int, slots: Sequence[int], hidden: torch.Tensor, positions: torch.Tensor,
                  tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One layer's attention alone (for checks and custom layer loops): hidden [B, S, hidden]
        (the layer's attention input, after input_layernorm) at positions [B, S]; appends the S
        rows of this layer (each request's length grows by S; other layers' rows there stay
        unwritten). tree_mask as in `forward`. Returns [B, S, hidden], the output of the model's
        self_attn for the same tokens."""
        B, S, _ = hidden.shape
        mask = self._tree_mask(tree_mask, B, S)
        index = self.cache.append(slots, S)
        cos, sin = self.model.model.rotary_emb(hidden, positions.to(self.device))
        return self._attend(layer, hidden, cos, sin, index, self.cache.block_table(slots), self.cache.seqlens(slots),
                            mask, max(self.cache.length(s) for s in slots))

    def _tree_mask(self, tree_mask: torch.Tensor | None, B: int, S: int) -> torch.Tensor | None:
        """tree_mask checked to be [B, S, S], as the contiguous bool tensor on the model's device
        that the backend takes; None stays None (causal)."""
        if tree_mask is None:
            return None
        if tuple(tree_mask.shape) != (B, S, S):
            raise InputError(f"tree_mask.shape: got {tuple(tree_mask.shape)}, expected [{B}, {S}, {S}]")
        return tree_mask.to(device=self.device, dtype=torch.bool).contiguous()

    def _attend(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: RowIndex,
                table: torch.Tensor, seqlens: torch.Tensor, mask: torch.Tensor | None, longest: int) -> torch.Tensor:
        """Layer i's attention of x [B, S, hidden]: writes the rows, runs the backend, projects out."""
        mla = self.mla[i]
        q, rows = mla.project(x, cos, sin)
        self.cache.write(i, index, rows)
        latent = self.backend(q.contiguous(), self.cache.layer(i), table, seqlens, softmax_scale=mla.scale,
                              causal=True, tree_mask=mask, head_dim_v=mla.latent, kv_scale=self.cache.kv_scale(i),
                              max_seqlen_k=longest)
        return mla.output(latent.to(x.dtype))

    # -- prefill and verify -----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Appends each prompt to its request (positions continue from the request's length),
        causal, in chunks of at most MAX_SEQLEN_Q tokens; requests whose chunks have the same
        length run together. Returns the logits after each prompt's last token, [B, vocab]."""
        if len(slots) != len(prompts) or any(len(p) == 0 for p in prompts):
            raise InputError(f"prompts: got {len(prompts)} prompts of lengths {[len(p) for p in prompts]}, expected "
                             f"one non-empty prompt per slot ({len(slots)})")
        last: list[torch.Tensor | None] = [None] * len(slots)
        done = [0] * len(slots)
        while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
            groups: dict[int, list[int]] = {}
            for b, p in enumerate(prompts):
                if done[b] < len(p):
                    groups.setdefault(min(MAX_SEQLEN_Q, len(p) - done[b]), []).append(b)
            for size, members in groups.items():
                tokens = torch.tensor([list(prompts[b][done[b]:done[b] + size]) for b in members], dtype=torch.long)
                starts = torch.tensor([self.cache.length(slots[b]) for b in members])
                positions = starts[:, None] + torch.arange(size)[None, :]
                logits = self.forward([slots[b] for b in members], tokens, positions)
                for j, b in enumerate(members):
                    done[b] += size
                    last[b] = logits[j, -1]
        return torch.stack(last)

    @torch.no_grad()
    def verify(self, slots: Sequence[int], trees: Sequence[DraftTree]) -> torch.Tensor:
        """Runs one draft tree per request (node 0: the request's pending token) and appends its
        rows. Trees are padded to the largest (`DraftTree.padded`); all chains run causal, else
        with the trees' masks. Node k sits at position (length + depth of k). Returns logits
        [B, S, vocab]: row k is the model's prediction after node k (rows past a tree's own size
        belong to padding). Follow with `accept` for each request."""
        if len(slots) != len(trees):
            raise InputError(f"trees: got {len(trees)}, expected one per slot ({len(slots)})")
        S = max(len(t) for t in trees)
        if S > MAX_SEQLEN_Q:
            raise InputError(f"trees: got a tree of {S} nodes, expected at most {MAX_SEQLEN_Q} "
                             "(mlagen.dsl.spec.MAX_SEQLEN_Q)")
        padded = [t.padded(S) for t in trees]
        tokens = torch.tensor([[max(tok, 0) for tok in t.tokens] for t in padded], dtype=torch.long)
        starts = [self.cache.length(s) for s in slots]
        positions = torch.tensor([[start + d for d in t.depths()] for start, t in zip(starts, padded, strict=True)])
        mask = None if all(t.is_chain for t in padded) else torch.stack([t.mask() for t in padded])
        logits = self.forward(slots, tokens, positions, mask)
        for s, start, tree in zip(slots, starts, trees, strict=True):
            self._drafts[s] = (start, tree)
        return logits

    def accept(self, slot: int, nodes: Sequence[int]) -> None:
        """Keeps the rows of a verified tree's accepted nodes as the request's next committed rows
        and drops the tree's other rows. nodes: a path from the root, [0, child of 0, its child,
        ...] (`drafting.accept_greedy` gives it)."""
        if slot not in self._drafts:
            raise InputError(f"slot: got {slot}, expected a slot verified since its last accept")
        start, tree = self._drafts[slot]
        nodes = [int(k) for k in nodes]
        if not nodes or nodes[0] != 0 or any(not 0 < k < len(tree) or tree.parents[k] != p
                                             for p, k in zip(nodes, nodes[1:], strict=False)):
            raise InputError(f"nodes: got {nodes}, expected a path from the root of the verified tree "
                             f"(parents {list(tree.parents)})")
        del self._drafts[slot]
        self.cache.keep(slot, start, nodes)


@torch.no_grad()
def model_logits(model: torch.nn.Module, context: Sequence[int], tree: DraftTree) -> torch.Tensor:
    """The model's own forward (its own attention, no cache) over a request's committed tokens
    `context` followed by a draft tree: context token j at position j sees tokens 0..j; node k
    at position len(context) + depth sees the context, its ancestors and itself, through a 4D
    additive attention mask. Returns the tree's logits [len(tree), vocab] in the model's dtype.
    Padding nodes are embedded as token 0."""
    check_model(model)
    weight = model.model.embed_tokens.weight
    n, S = len(context), len(tree)
    ids = torch.tensor([list(context) + [max(t, 0) for t in tree.tokens]], dtype=torch.long, device=weight.device)
    positions = torch.tensor([list(range(n)) + [n + d for d in tree.depths()]], device=weight.device)
    seen = torch.zeros(n + S, n + S, dtype=torch.bool)
    seen[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    seen[n:, :n] = True
    seen[n:, n:] = tree.mask()
    mask = torch.zeros(n + S, n + S, dtype=weight.dtype).masked_fill(~seen, torch.finfo(weight.dtype).min)
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask[None, None].to(weight.device),
                use_cache=False)
    return out.logits[0, n:]


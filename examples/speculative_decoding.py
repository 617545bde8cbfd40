"""Greedy speculative decoding of a DeepSeek-V3 / Kimi K2 model with mlagen's verify attention.

    python examples/speculative_decoding.py                       # a small seeded model, CUDA
    python examples/speculative_decoding.py --device cpu --new-tokens 8 --batch 2
    python examples/speculative_decoding.py --model /path/to/checkpoint --dtype bf16

Without --model it builds a small DeepSeek-V3 config with Kimi K2's attention shapes (64 heads,
kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), a few layers, a
small hidden size and vocabulary and a few MoE experts, with random weights from --seed; with
--model it loads a local checkpoint (`from_pretrained(local_files_only=True)`).

It prefills a batch of prompts, then decodes --new-tokens per request three ways through the same
integration (`mlagen.integrations`): plain greedy (one token per step), prompt-lookup chains and
prompt-lookup trees (several candidate continuations merged). Each verify step accepts the
longest drafted path that matches the model's greedy choices and keeps those rows in the paged
latent cache. It prints the accepted drafts per step, tokens per second against plain greedy,
the share of time in attention, and whether each mode's text equals plain greedy's. Where it does
not, it prints the first token that differs and the model's own top-2 logits there: in bf16 two
correct computations part at a near tie (a margin of a few units in the last place), and greedy
texts that part once go separate ways. tests/test_gpu_integration.py checks every emitted token
against the model's own greedy choice wherever the margin is clear of the logits' difference.
Attention runs on `mlagen.verify_attention` on CUDA and on `mlagen.reference` on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence

import torch

from mlagen.integrations import (
    AttentionBackend,
    DecodeResult,
    DeepseekV3Verifier,
    DraftTree,
    default_backend,
    lookup_tree,
    model_logits,
    no_draft,
    speculative_decode,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
# Kimi K2's attention: 64 heads over one 512 + 64 latent head.
KIMI_K2_ATTENTION = dict(num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512, qk_rope_head_dim=64,
                         qk_nope_head_dim=128, v_head_dim=128)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="speculative_decoding.py", description=__doc__.splitlines()[0])

    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"got {value}, expected an int >= 1")
        return value

    parser.add_argument("--model", help="a local DeepSeek-V3 / Kimi K2 checkpoint folder (default: a seeded model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--batch", type=positive, default=4, help="requests decoded together (default 4)")
    parser.add_argument("--new-tokens", type=positive, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--prompt-len", type=positive, default=48, help="longest prompt (default 48)")
    parser.add_argument("--draft-len", type=positive, default=8, help="drafted tokens per candidate (default 8)")
    parser.add_argument("--branches", type=positive, default=4, help="candidates merged per tree (default 4)")
    parser.add_argument("--layers", type=positive, default=2, help="decoder layers of the seeded model (default 2)")
    parser.add_argument("--hidden-size", type=positive, default=1024, help="seeded model's hidden size (default 1024)")
    parser.add_argument("--vocab", type=positive, default=4096, help="seeded model's vocabulary (default 4096)")
    parser.add_argument("--experts", type=positive, default=4, help="seeded model's routed experts (default 4)")
    parser.add_argument("--experts-per-token", type=positive, default=2, help="routed experts per token (default 2)")
    parser.add_argument("--kv-format", choices=("e4m3", "ds_mla"), help="an FP8 latent cache (default: the dtype)")
    parser.add_argument("--kv-scale", type=float, help="the e4m3 cache's scale (default 1.0: rows up to 448)")
    parser.add_argument("--page-size", type=positive, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                        help="run each mode once before timing it (compiles the kernels for every draft size; "
                        "default: on CUDA)")
    args = parser.parse_args(argv)
    if not 2 <= args.experts_per_token <= args.experts:     # the router scores each group by its top 2
        parser.error(f"--experts-per-token {args.experts_per_token}, --experts {args.experts}: expected "
                     "2 <= experts per token <= experts")
    return args


def seeded_config(args: argparse.Namespace) -> object:
    """A small DeepSeek-V3 config with Kimi K2's attention shapes: q_lora_rank 1.5 x the hidden
    size (Kimi K2's 1536 at 1024), layer 0 dense, the others MoE with --experts routed experts
    (--experts-per-token per token) and a shared one."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        moe_intermediate_size=args.hidden_size // 4, num_hidden_layers=args.layers, n_shared_experts=1,
        n_routed_experts=args.experts, n_group=1, topk_group=1, num_experts_per_tok=args.experts_per_token,
        first_k_dense_replace=1, q_lora_rank=3 * args.hidden_size // 2, max_position_embeddings=4096,
        rope_interleave=True, attn_implementation="eager", experts_implementation="eager", **KIMI_K2_ATTENTION)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The checkpoint at --model, or the seeded model, on --device in --dtype, in eval mode."""
    from transformers import DeepseekV3ForCausalLM

    dtype = DTYPES[args.dtype or ("bf16" if torch.device(args.device).type == "cuda" else "fp32")]
    if args.model:
        model = DeepseekV3ForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=dtype,
                                                      attn_implementation="eager")
    else:
        torch.manual_seed(args.seed)
        model = DeepseekV3ForCausalLM(seeded_config(args))
    return model.to(device=args.device, dtype=dtype).eval()


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """--batch prompts of different lengths (up to --prompt-len) from --seed: random tokens with a
    phrase repeated in each, as text often repeats itself, so that prompt lookup finds matches."""
    gen = torch.Generator().manual_seed(args.seed)
    prompts = []
    for b in range(args.batch):
        length = max(4, args.prompt_len - 7 * b)
        phrase = torch.randint(0, vocab, (6,), generator=gen).tolist()
        filler = torch.randint(0, vocab, (length,), generator=gen).tolist()
        prompts.append((filler[: length // 2] + phrase + filler[length // 2:] + phrase)[:length])
    return prompts


class TimedBackend:
    """An attention backend that adds up the seconds spent in it (synchronizing CUDA around each
    call, so the time is the attention's own)."""

    def __init__(self, inner: AttentionBackend, device: torch.device) -> None:
        self.inner, self.device, self.seconds = inner, device, 0.0

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        self._sync()
        start = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self._sync()
        self.seconds += time.perf_counter() - start
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_mode(verifier: DeepseekV3Verifier, timer: TimedBackend, prompts: list[list[int]], new_tokens: int,
             drafter: object) -> tuple[DecodeResult, float, float]:
    """One timed decoding run: (result, seconds, seconds in attention)."""
    if verifier.device.type == "cuda":
        torch.cuda.synchronize(verifier.device)
    timer.seconds = 0.0
    start = time.perf_counter()
    result = speculative_decode(verifier, prompts, new_tokens, drafter=drafter)
    if verifier.device.type == "cuda":
        torch.cuda.synchronize(verifier.device)
    return result, time.perf_counter() - start, timer.seconds


def first_difference(model: torch.nn.Module, prompt: list[int], tokens: list[int], greedy: list[int]) -> str | None:
    """Where `tokens` (one request's decoded tokens) first part from `greedy`'s, and the model's own
    top-2 logits there (its own forward over the prompt and greedy's tokens before that point), or
    None where they do not part."""
    k = next((i for i, (t, g) in enumerate(zip(tokens, greedy, strict=True)) if t != g), None)
    if k is None:
        return None
    seen = prompt + greedy[:k]
    logits = model_logits(model, seen[:-1], DraftTree.chain(seen[-1:]))[-1]
    (a, b), (ta, tb) = (v.tolist() for v in logits.float().topk(2))
    ulp = 2.0 ** (torch.frexp(torch.tensor(abs(a) or 1.0)).exponent.item() - 1) * torch.finfo(logits.dtype).eps
    return (f"new token {k}: this run {tokens[k]}, greedy {greedy[k]}; the model's own top-2 there: {ta} at "
            f"{a:.4f}, {tb} at {b:.4f} (margin {a - b:.4f}, {(a - b) / ulp:.1f} units in the last place)")


def main(argv: Sequence[str] | None = None) -> dict[str, DecodeResult]:
    """Runs the three modes and prints their figures; returns each mode's `DecodeResult`."""
    args = parse_args(argv)
    device = torch.device(args.device)
    model = build_model(args)
    timer = TimedBackend(default_backend(device), device)
    prompts = make_prompts(args, model.config.vocab_size)
    longest = max(map(len, prompts)) + args.new_tokens + args.draft_len * args.branches + 1
    verifier = DeepseekV3Verifier(model, backend=timer, page_size=args.page_size, max_requests=args.batch,
                                  max_context=longest, kv_format=args.kv_format,
                                  kv_scale=args.kv_scale if args.kv_format == "e4m3" else None)
    c = model.config
    print(f"model: {args.model or 'seeded'}, {c.num_hidden_layers} layers, {c.num_attention_heads} heads, "
          f"latent {c.kv_lora_rank} + rope {c.qk_rope_head_dim}, vocab {c.vocab_size}, {verifier.dtype}, "
          f"{device}; attention: {getattr(timer.inner, 'name', type(timer.inner).__name__)}"
          f"{', cache ' + args.kv_format if args.kv_format else ''}")
    print(f"prompts: {len(prompts)} of lengths {[len(p) for p in prompts]}, {args.new_tokens} new tokens each")
    modes = {
        "greedy": no_draft,
        "chain": functools.partial(lookup_tree, draft_len=args.draft_len, branches=1),
        "tree": functools.partial(lookup_tree, draft_len=args.draft_len, branches=args.branches),
    }
    warmup = args.warmup if args.warmup is not None else device.type == "cuda"
    speculative_decode(verifier, prompts, 2)        # untimed: first calls (lazy set-up) out of the timings
    results: dict[str, DecodeResult] = {}
    base_rate = None
    for name, drafter in modes.items():
        if warmup:
            run_mode(verifier, timer, prompts, args.new_tokens, drafter)
        result, seconds, attention = run_mode(verifier, timer, prompts, args.new_tokens, drafter)
        results[name] = result
        rate = len(prompts) * args.new_tokens / seconds
        base_rate = base_rate or rate
        if name != "greedy":
            for step, emitted in enumerate(result.emitted, 1):
                print(f"  {name} step {step}: accepted drafts per request {[e - 1 for e in emitted]}")
        same = sum(t == g for t, g in zip(result.tokens, results["greedy"].tokens, strict=True))
        per_step = sum(map(sum, result.emitted)) / max(1, sum(map(len, result.emitted)))
        print(f"{name}: {result.steps} steps, {per_step:.2f} tokens per request-step, {rate:.1f} tokens/s "
              f"({rate / base_rate:.2f}x greedy), attention {100 * attention / seconds:.0f}% of the time, "
              f"text equal to greedy's in {same} of {len(prompts)} requests")
        for r, (tokens, greedy) in enumerate(zip(result.tokens, results["greedy"].tokens, strict=True)):
            where = first_difference(model, prompts[r], tokens, greedy)
            if where:
                print(f"  request {r} parts from greedy at {where}")
    return results


if __name__ == "__main__":
    main()

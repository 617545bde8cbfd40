"""A/B timing of explicit variants on key rows (run from a repo root; label in argv[1])."""
import os, sys, time
sys.path.insert(0, "tests")
label = sys.argv[1]
out = open(os.path.join(os.environ["OUT"], f"ab_{label}.txt"), "w", buffering=1)
def say(*a):
    print(*a, file=out); print(label, *a, flush=True)
import torch
from helpers import make_case, assert_matches
import mlagen
from mlagen.spec import parse_variant
from mlagen.grids import Row
from mlagen.workload import make_workload, mlagen_call
from mlagen.timing import measure, l2_bytes
VS = [None, "mma_ht64_qt1_bn64_w8_st2_spa_sm90a", "mma_ht64_qt1_bn64_w8_st2_spa_pvm_sm90a",
      "mma_ht64_qt1_bn32_w8_st2_spa_pvm_sm90a", "mma_ht64_qt1_bn64_w4_st2_spa_pvm_sm90a"]
for i, name in enumerate(VS[1:]):
    v = parse_variant(name)
    for j, (b, s, pre, mask) in enumerate([(2, 9, [1000, 30], "causal"), (3, 5, [3000, 0, 64], "tree")]):
        c = make_case(batch=b, seqlen_q=s, heads=64, prefixes=pre, page_size=64, mask=mask, seed=10 * i + j)
        try:
            o, l = mlagen.verify_attention(c.q, c.kv_cache, c.block_table, c.cache_seqlens, variant=v, return_lse=True, **c.kwargs())
            torch.cuda.synchronize(); assert_matches(o, l, c); say("correct", name, b, s, pre, mask)
        except Exception as e:
            say("FAIL", name, repr(e)[:200])
ROWS = [(64, 1, 9, 256), (64, 1, 9, 1024), (64, 1, 33, 256), (64, 1, 9, 4096), (64, 1, 9, 65536),
        (16, 64, 4, 4096), (8, 16, 9, 16384), (64, 8, 9, 4096), (128, 32, 4, 4096)]
for h, b, s, pre in ROWS:
    w = make_workload(Row(h, b, s, pre), 64, "causal", "bf16", l2_bytes(0))
    cells = []
    for name in VS:
        if name and h != 64: continue
        v = parse_variant(name) if name else None
        try:
            cells.append("%s=%.1f" % ((name or "dispatch").replace("mma_ht64_qt1_", "").replace("_spa", "").replace("_sm90a", ""), measure(mlagen_call(w, v), w.sets).us))
        except Exception as e:
            cells.append("%s=ERR %s" % (name, repr(e)[:80]))
    say(f"{h},{b},{s},{pre}", " ".join(cells))

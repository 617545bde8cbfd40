"""benchmarks/trace_blocks.py (warm, globaltimer) under a given MERGE_TARGET_BLOCKS (session 26):

    python3 benchmarks/h200-2026-11-30-s26/scripts/trace_target.py TARGET H B S PREFIX
"""

import sys

sys.path.insert(0, "benchmarks")
import trace_blocks  # noqa: E402

import mlagen.validate  # noqa: E402, F401

sys.modules["mlagen.validate"].MERGE_TARGET_BLOCKS = int(sys.argv[1])
trace_blocks.main(*(int(a) for a in sys.argv[2:6]), warm=True, gt=True)

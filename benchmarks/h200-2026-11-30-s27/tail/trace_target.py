"""trace_blocks.main under a given MERGE_TARGET_BLOCKS: python3 dev/trace_target.py TARGET H B S PREFIX"""
import sys
sys.path.insert(0, "benchmarks")
import mlagen.validate  # noqa: F401
sys.modules["mlagen.validate"].MERGE_TARGET_BLOCKS = int(sys.argv[1])
import trace_blocks
trace_blocks.main(*(int(a) for a in sys.argv[2:6]), warm=True, gt=True)

#!/usr/bin/env python3
"""Time qattn's paged decode in each cache format and QK path beside torch SDPA (flash, cuDNN), L2-warm
or HBM-cold, and the fused cache write beside a plain copy of the same bytes: the same command as
`qattn bench decode` (see --help).

    tools/bench_decode.py --shape 8x32768 --shape 64x4096 --shape 1x131072 --json decode.json
    tools/bench_decode.py --format e4m3-e4m3 --page-size 16 --kv-heads 8 --heads 64 --shape 16x8192
    tools/bench_decode.py --preset contract --json contract.json --markdown

Runs from an install or straight from a checkout (the repository root is put on sys.path when qattn
is not importable).
"""
import sys
from pathlib import Path

try:
    import qattn  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.cli_bench import bench_decode

if __name__ == "__main__":
    bench_decode(prog_name="tools/bench_decode.py")

"""tools/bench_call.py without a GPU: its shape argument and its usage errors. CPU only."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import bench_call  # noqa: E402


def test_shape_parses_bxhxl():
    assert bench_call.shape("4x32x4096") == (4, 32, 4096)
    assert bench_call.shape("1X8X77") == (1, 8, 77)
    for bad in ("4x32", "4x32x0", "axbxc", "4x32x4096x1"):
        with pytest.raises(argparse.ArgumentTypeError, match="BxHxL|positive"):
            bench_call.shape(bad)


@pytest.mark.parametrize("args, message", [(["--shape", "4x32"], "--shape"), (["--head-dim", "96"], "--head-dim"),
                                           (["--format", "f16"], "--format"), (["--causal", "maybe"], "--causal")])
def test_usage_errors_name_the_argument(args, message):
    result = subprocess.run([sys.executable, str(TOOLS / "bench_call.py"), *args], capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr

"""examples/decode_loop.py: its arguments on the CPU, a short run on the GPU."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DECODE_LOOP = ROOT / "examples" / "decode_loop.py"


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(DECODE_LOOP), *args], capture_output=True, text=True, cwd="/",
                          env=env, timeout=timeout)


def test_decode_loop_help_and_bad_arguments():
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    assert "--speculative" in result.stdout and "--max-rel-l2" in result.stdout
    for bad in (["--speculative", "0"], ["--speculative", "17"], ["--prompt", "4096", "--ctx", "2048"]):
        result = _run(*bad)
        assert result.returncode == 2, (bad, result.stdout, result.stderr)
        assert "expected 1 <= --speculative <= 16" in result.stderr, bad


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,bound", [("f16-f16", 2e-3), ("e4m3-e4m3", 6e-2), ("i8-i8", 6e-2)])
def test_decode_loop_checks_every_step_it_says(fmt, bound):
    """A short grown cache (speculative steps of 3 tokens, so the last step stops short of --ctx): one FP64
    check per --check-every positions from the prompt on, each within the format's bound, and the steps
    counted as written."""
    ctx, prompt, every, lq = 1500, 509, 250, 3
    result = _run("--format", fmt, "--ctx", str(ctx), "--prompt", str(prompt), "--check-every", str(every),
                  "--speculative", str(lq), "--heads", "8", "--kv-heads", "2", "--page-size", "16")
    assert result.returncode == 0, result.stdout + result.stderr
    checks = [(int(m.group(1)), float(m.group(2)))
              for m in re.finditer(r"^\s+(\d+)\s+([0-9.e+-]+)$", result.stdout, re.MULTILINE)]
    steps = (ctx - prompt) // lq
    positions = [prompt + i * lq + lq for i in range(steps)]
    expected, next_check = [], prompt
    for pos in positions:
        if pos - lq >= next_check:
            expected.append(pos)
            next_check += every
    assert [p for p, _ in checks] == expected
    assert all(0 < err <= bound for _, err in checks), checks
    summary = re.search(r"^(\d+) steps in [0-9.]+ s: \d+ steps/s \(\d+ tokens/s\); worst rel_l2 ([0-9.e+-]+)$",
                        result.stdout, re.MULTILINE)
    assert summary is not None, result.stdout
    assert int(summary.group(1)) == steps and float(summary.group(2)) == pytest.approx(max(e for _, e in checks),
                                                                                        rel=1e-3)

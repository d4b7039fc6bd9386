"""Deployments that run with QATTN_NO_JIT=1: `qattn compile --queries N` builds the kernels that calls of N query
rows run on this GPU (on sm_90a a routed wgmma kernel, not the family's default, and the variants its launcher runs for
strides the TMA cannot read), and a fresh process then runs those calls from the cache alone; before the compile the
same calls fail with KernelNotCached."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

CALL = """
import sys
import cupy as cp
import qattn
fmt, d, causal, queries = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "causal", int(sys.argv[4])
rng = cp.random.default_rng(11)
q = rng.standard_normal((2, 8, queries, d), dtype=cp.float32).astype(cp.float16)
k, v = (rng.standard_normal((2, 2, queries + 37, d), dtype=cp.float32).astype(cp.float16) for _ in range(2))
kv = (k, v)
if fmt.startswith("kv8"):  # attention over an int8 cache, whose writer runs in the call's process too
    q, cache = q.astype(cp.float32), qattn.KVCacheInt8.from_kv(k, v)
    kv, (k, v) = (cache, None), cache.dequantize()
out = cp.full(q.shape, cp.nan, q.dtype)
qattn.attention(q, *kv, format=fmt, causal=causal, out=out)
errors = qattn.metrics.compare(out, qattn.reference.attention(q, k, v, causal=causal))
tolerance = qattn.recipe(fmt).tolerance.rel_l2
print(f"rel_l2={errors.rel_l2:.3e} tolerance={tolerance}")
assert errors.rel_l2 <= tolerance, errors
if fmt == "f16":  # K and V broadcast over the batch (stride 0), which the TMA cannot read: another kernel runs
    k, v = (cp.broadcast_to(x[:1], x.shape) for x in (k, v))
    out = qattn.attention(q, k, v, format=fmt, causal=causal)
    errors = qattn.metrics.compare(out, qattn.reference.attention(q, k, v, causal=causal))
    print(f"broadcast K/V rel_l2={errors.rel_l2:.3e}")
    assert errors.rel_l2 <= tolerance, errors
"""

CASES = [("f16", 128, "causal", 1024), ("f16", 64, "full", 2048), ("i8-f8", 128, "causal", 4096),
         ("i8-f16", 128, "full", 1000), ("kv8-imma", 128, "full", 300)]


def _run(args, env):
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("fmt, d, mask, queries", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_compiled_calls_run_without_the_compiler(tmp_path, fmt, d, mask, queries):
    env = {**os.environ, "QATTN_CACHE_DIR": str(tmp_path / "cache"), "QATTN_TUNED": "0"}
    call = ["-c", CALL, fmt, str(d), mask, str(queries)]
    cold = _run(call, {**env, "QATTN_NO_JIT": "1"})
    assert cold.returncode != 0 and "KernelNotCached" in cold.stderr, cold.stderr[-2000:]
    compiled = _run(["-m", "qattn", "compile", "-f", fmt, "-d", str(d), "--causal" if mask == "causal" else "--no-causal",
                     "--queries", str(queries)], env)
    assert compiled.returncode == 0, compiled.stdout[-2000:] + compiled.stderr[-2000:]
    warm = _run(call, {**env, "QATTN_NO_JIT": "1"})
    assert warm.returncode == 0, warm.stdout[-2000:] + warm.stderr[-2000:]
    assert "rel_l2=" in warm.stdout

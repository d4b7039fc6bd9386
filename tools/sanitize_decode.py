#!/usr/bin/env python3
"""A small decode workload for compute-sanitizer: every decode format's writer (prompt runs and
scattered single tokens; with and without a pre-bias residual K, and with page means, Q/K channel
balancing and post- and pre-RoPE keys where K is 8-bit; a long prompt, more writer blocks than the
GPU holds at once) and decode kernel on each of its QK paths (GQA, speculative rows, short and empty
sequences, one and several splits), each output checked against the emulator (rel_l2 1e-3; 4e-3 on
sm_90a's fp8 path, recipes.emulator_rel_l2) and the long prompt's bytes against the host model, so a
silent corruption fails.

    compute-sanitizer --tool memcheck python tools/sanitize_decode.py
    compute-sanitizer --tool racecheck python tools/sanitize_decode.py --format e4m3-e4m3
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import qattn  # noqa: E402
from qattn.check import metrics  # noqa: E402
from qattn.formats.decode import emulate  # noqa: E402
from qattn.engine.spec import device_arch  # noqa: E402
from qattn.formats.decode.recipes import EIGHT_BIT, FORMATS, emulator_rel_l2, qk_paths  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", action="append", help="decode formats (default: all)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page of the decode caches (default 16)")
    args = ap.parse_args()
    import cupy
    import ml_dtypes

    rng = np.random.default_rng(0)
    failures = 0
    arch = device_arch()
    d, page, kv_heads = args.head_dim, args.page_size, 2
    k_bias = rng.standard_normal((kv_heads, d)) * 4
    rope = qattn.RoPE(rotary_dim=d // 2, style="gptj")  # partial rotary: the constant part too
    # (name, k_bias, k_mean, k_balance, rope, k_bias_layout): all but plain and bias for an 8-bit K only
    options = (("plain", None, "off", None, None, "post-rope"), ("bias", k_bias, "off", None, None, "post-rope"),
               ("mean", None, "page", None, None, "post-rope"), ("bal", None, "off", "calibrate", None, "post-rope"),
               ("rope", k_bias, "off", None, rope, "post-rope"),
               ("all", k_bias, "page", "calibrate", rope, "post-rope"), ("pre", k_bias, "off", None, rope, "pre-rope"))
    variants = ((f, *o) for f in args.format or FORMATS for o in options
                if o[0] in ("plain", "bias") or f.split("-")[0] in EIGHT_BIT)
    for fmt, variant, bias, k_mean, balance, key_rope, layout in variants:
        dtype = ml_dtypes.bfloat16 if "bf16" in fmt else np.float16
        lens = np.array([0, 5, 70, 300], np.int32)
        max_pages = -(-int(lens.max()) // page) + 1
        cache = qattn.PagedKVCache(4 * max_pages, page, kv_heads, d, k=fmt.split("-")[0], v=fmt.split("-")[1],
                                   k_bias=bias, k_mean=k_mean, k_balance=balance, rope=key_rope, k_bias_layout=layout)
        table = rng.permutation(4 * max_pages).reshape(4, max_pages).astype(np.int32)
        for b, n in enumerate(lens):
            k, v = (rng.standard_normal((n, kv_heads, d)).astype(dtype) for _ in range(2))
            k[:, :, :3] *= 40  # outlier channels: balancing gets α > 1
            slots = (table[b, np.arange(n) // page] * page + np.arange(n) % page).astype(np.int32)
            positions = cupy.arange(n, dtype=cupy.int32) if key_rope is not None and layout == "post-rope" else None
            if n > 1:  # a prompt, then the last token on its own
                cache.write(cupy.asarray(k[:-1]), cupy.asarray(v[:-1]), cupy.asarray(slots[:-1]),
                            positions=None if positions is None else positions[:-1])
            if n:
                cache.write(cupy.asarray(k[-1:]), cupy.asarray(v[-1:]), cupy.asarray(slots[-1:]),
                            positions=None if positions is None else positions[-1:])
        host = cache.host()
        paths = ("transform",) if layout == "pre-rope" else qk_paths(fmt)  # pre-RoPE keys: the transform path only
        for (lq, splits), path in ((shape, path) for shape in ((1, 1), (3, 3), (2, None)) for path in paths):
            q = rng.standard_normal((4, 4 * kv_heads, lq, d)).astype(dtype)
            lens_q = np.maximum(lens, 0)
            out = qattn.decode(cupy.asarray(q), cache, cupy.asarray(table), cupy.asarray(lens_q), splits=splits,
                               qk=path)
            used = splits or qattn.formats.decode.host.splits_for(cache, 4, 4 * kv_heads, lq, max_pages, qk=path)
            want = emulate.emulate(q, host, table, lens_q, splits=used, qk=path)
            err = metrics.compare(cupy.asnumpy(out).astype(np.float32), want)
            ok = err.nonfinite == 0 and err.rel_l2 <= emulator_rel_l2(path, arch)
            failures += not ok
            print(f"{fmt:10} {path:9} {variant:5} lq={lq} splits={used}: "
                  f"rel_l2 vs emulator {err.rel_l2:.2e} {'ok' if ok else 'FAIL'}")
    for fmt in args.format or FORMATS:
        failures += not long_prompt_matches(fmt, d, rng)
    cupy.cuda.runtime.deviceSynchronize()
    return 1 if failures else 0


def long_prompt_matches(fmt: str, d: int, rng) -> bool:
    """A prompt of 40000 tokens over 2 kv heads (5000 writer blocks, several waves of them), pages shuffled, a
    few slots padded: its bytes are the host model's."""
    import cupy
    import ml_dtypes

    from qattn.formats.decode.quant import HostPagedCache

    dtype = ml_dtypes.bfloat16 if "bf16" in fmt else np.float16
    tokens, page, kv_heads = 40000, 32, 2
    pages = -(-tokens // page)
    cache = qattn.PagedKVCache(pages, page, kv_heads, d, k=fmt.split("-")[0], v=fmt.split("-")[1])
    host = HostPagedCache.empty(fmt, pages, page, kv_heads, d, "token")
    slots = (rng.permutation(pages)[np.arange(tokens) // page] * page + np.arange(tokens) % page).astype(np.int64)
    slots[rng.choice(tokens, 30, replace=False)] = -1
    k, v = (rng.standard_normal((tokens, kv_heads, d)).astype(dtype) for _ in range(2))
    cache.write(cupy.asarray(k), cupy.asarray(v), cupy.asarray(slots))
    host.write(k, v, slots)
    got = cache.host()
    same = all(getattr(host, side) is None or np.array_equal(getattr(got, side), getattr(host, side))
               for side in ("k", "v", "k_scale", "v_scale"))
    print(f"{fmt:10} writer, {tokens} tokens: {'same bytes as the host model' if same else 'FAIL'}")
    return same


if __name__ == "__main__":
    sys.exit(main())

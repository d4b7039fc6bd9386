"""What the GPU decode tests of each cache option share: decode over one, three and the planned splits
checked against the emulator, and a decode step (cache write + decode) captured once in a CUDA graph and
replayed as tokens arrive, checked against a fresh call and the emulator."""
from __future__ import annotations

import numpy as np

import qattn
from qattn.check import metrics
from qattn.formats.decode import emulate as emu

EMU_REL_L2 = 1e-3
QUERY_HEADS = 8


def decode_over_splits(q, cache, host, table, lens, *, qk: str = "auto", emu_qk: str | None = None,
                       emu_rel_l2: float = EMU_REL_L2, lse_tol: float = 2e-3) -> list[tuple]:
    """qattn.decode of q over splits 1, 3 and the planned count (QK path qk), each into a NaN-poisoned
    output: every element written, within emu_rel_l2 of the emulator (path emu_qk, else qk) at the split
    count used, the LSE within lse_tol (relative and absolute). Returns [(splits, output as fp32)] for the
    caller's own checks."""
    import cupy

    qd, td, ld = cupy.asarray(q), cupy.asarray(table), cupy.asarray(lens)
    outputs = []
    for splits in (1, 3, None):
        out = cupy.full(q.shape, np.nan, dtype=qd.dtype)
        got, lse = qattn.decode(qd, cache, td, ld, splits=splits, out=out, return_lse=True, qk=qk)
        got = cupy.asnumpy(got).astype(np.float32)
        assert not np.isnan(got).any(), "an output element was left unwritten"
        used = splits if splits is not None else qattn.formats.decode.host.splits_for(cache, *q.shape[:3],
                                                                                       table.shape[1], qk=qk)
        want, want_lse = emu.emulate(q, host, table, lens, splits=used, return_lse=True, qk=emu_qk or qk)
        assert metrics.compare(got, want).rel_l2 <= emu_rel_l2, (splits, metrics.compare(got, want))
        np.testing.assert_allclose(cupy.asnumpy(lse), want_lse, rtol=lse_tol, atol=lse_tol)
        outputs.append((splits, got))
    return outputs


def replay_decode_steps(cache, host, table, lens, *, kv_heads: int, head_dim: int, qk: str, new_k, page_size: int,
                        positions: bool = False, steps: int = 3, seed: int = 9) -> None:
    """Capture cache.write (with each token's position where `positions`) + qattn.decode once on a
    non-blocking stream, then replay it `steps` times with sequences of lens + step tokens (the new token
    of each on its page of `table`), the inputs changed on the graph's own stream: each replay's output
    equals a fresh call's bit for bit and the emulator's on the host model written with the same tokens
    (rel_l2 EMU_REL_L2); the cache's K bytes end as the host model's. new_k(rng, shape) -> new K tokens
    (float)."""
    import cupy

    b = len(lens)
    table_d, lens_d = cupy.asarray(table), cupy.asarray(lens + 1)
    slots, positions_d = cupy.zeros(b, cupy.int32), cupy.zeros(b, cupy.int32)
    k_new, v_new = (cupy.zeros((b, kv_heads, head_dim), cupy.float16) for _ in range(2))
    q, out = (cupy.zeros((b, QUERY_HEADS, 1, head_dim), cupy.float16) for _ in range(2))
    qattn.decode(q, cache, table_d, lens_d, out=out, splits=1, qk=qk)  # builds, plans
    write_options = {"positions": positions_d} if positions else {}
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cache.write(k_new, v_new, slots, stream=stream, **write_options)
        qattn.decode(q, cache, table_d, lens_d, out=out, stream=stream, splits=1, qk=qk)
        graph = stream.end_capture()
    rng = np.random.default_rng(seed)
    for step in range(steps):
        n = lens + step
        slot = (table[np.arange(b), n // page_size] * page_size + n % page_size).astype(np.int32)
        kk = new_k(rng, (b, kv_heads, head_dim)).astype(np.float16)
        vv = rng.standard_normal((b, kv_heads, head_dim)).astype(np.float16)
        qq = rng.standard_normal((b, QUERY_HEADS, 1, head_dim)).astype(np.float16)
        with stream:  # the inputs change on the graph's stream (a non-blocking stream does not wait for others)
            slots[...], positions_d[...] = cupy.asarray(slot), cupy.asarray(n.astype(np.int32))
            k_new[...], v_new[...], q[...] = cupy.asarray(kk), cupy.asarray(vv), cupy.asarray(qq)
            lens_d[...] = cupy.asarray(n + 1)
            graph.launch(stream)
        stream.synchronize()
        host.write(kk, vv, slot, **({"positions": n} if positions else {}))
        fresh = cupy.asnumpy(qattn.decode(q, cache, table_d, lens_d, splits=1, qk=qk))
        np.testing.assert_array_equal(cupy.asnumpy(out), fresh)
        want = emu.emulate(qq, host, table, n + 1, qk=qk)
        assert metrics.compare(fresh.astype(np.float32), want).rel_l2 <= EMU_REL_L2
    np.testing.assert_array_equal(cache.host().k, host.k)


def write_in_parts(cache, host, ks, vs, slots, *, scale: str, positions: bool = False) -> None:
    """Write each sequence's K, V [tokens, kv heads, D] to the GPU cache and its host model alike: every
    sequence's prompt (its first quarter) in one write, then 64 tokens of each sequence a write; with
    `positions`, each token's index in its sequence goes with it (post-RoPE keys)."""
    import cupy

    bounds = [[0, len(k) // 4] + list(range(len(k) // 4 + 64, len(k), 64)) + [len(k)] for k in ks]
    for w in range(max(len(b) for b in bounds) - 1):
        live = [i for i, b in enumerate(bounds) if w + 1 < len(b)]
        parts = [slice(bounds[i][w], bounds[i][w + 1]) for i in live]
        k = np.concatenate([ks[i][p] for i, p in zip(live, parts)])
        v = np.concatenate([vs[i][p] for i, p in zip(live, parts)])
        s = np.concatenate([slots[i][p] for i, p in zip(live, parts)])
        if len(s) == 0:
            continue
        pos = np.concatenate([np.arange(p.start, p.stop) for p in parts]).astype(s.dtype) if positions else None
        cache.write(cupy.asarray(k), cupy.asarray(v), cupy.asarray(s),
                    positions=None if pos is None else cupy.asarray(pos))
        host.write(k, v, s, scale=scale, positions=pos)


def assert_stored_alike(got, host) -> None:
    """A GPU cache's host copy holds the host model's K and V codes and scales bit for bit."""
    np.testing.assert_array_equal(got.k, host.k)
    np.testing.assert_array_equal(got.v, host.v)
    for side in ("k_scale", "v_scale"):
        if getattr(host, side) is not None:
            np.testing.assert_array_equal(getattr(got, side), getattr(host, side))

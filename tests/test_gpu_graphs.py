"""Every call path captured in a CUDA graph, with torch (torch.cuda.graph, outputs from the graph's
pool) and with CuPy (Stream.begin_capture, out= and a qattn.Workspace): after the inputs change in
place, a replay equals a fresh call, bit for bit (the kernels are deterministic)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import qattn
from qattn.engine.arrays import numpy_dtype

pytestmark = pytest.mark.gpu

SHAPES = [  # (batch, query heads, kv heads, queries, keys, head_dim): a tail, GQA, split-K sizes, persistent blocks
    (1, 4, 2, 77, 333, 64),
    (2, 8, 2, 200, 1100, 128),
    (2, 8, 2, 1100, 1100, 128),
]
PREFILL = ["f16", "bf16", "f32", "i8-f16", "i8-i8", "i8-f8"]
KV8 = ["kv8-imma", "kv8-split", "kv8-f32"]


def _dtype(fmt: str) -> str:
    return {"bf16": "bfloat16", "f32": "float32"}.get(fmt, "float32" if fmt.startswith("kv8") else "float16")


class _Case:
    """The inputs of one path as CuPy arrays (or torch tensors), refilled in place between replays."""

    def __init__(self, xp_name: str, shape, dtype: str, seed: int):
        self.rng = np.random.default_rng(seed)
        b, hq, hkv, lq, lk, d = shape
        self.torch = xp_name == "torch"
        self.arrays = {"q": self._new((b, hq, lq, d), dtype), "k": self._new((b, hkv, lk, d), dtype),
                       "v": self._new((b, hkv, lk, d), dtype)}

    def _new(self, shape, dtype):
        host = self.rng.standard_normal(shape).astype(np.float32)
        if self.torch:
            import torch

            return torch.tensor(host, device="cuda").to(getattr(torch, dtype))
        import cupy

        return cupy.asarray(host.astype(numpy_dtype(dtype)))

    def refill(self):
        for x in self.arrays.values():
            host = self.rng.standard_normal(tuple(x.shape)).astype(np.float32)
            if self.torch:
                import torch

                x.copy_(torch.tensor(host, device="cuda"))
            else:
                import cupy

                x[...] = cupy.asarray(host.astype(x.dtype))


def _host(x) -> np.ndarray:
    if type(x).__module__.split(".")[0] == "torch":
        return x.float().cpu().numpy()
    import cupy

    return cupy.asnumpy(x).astype(np.float32)


def _replay_torch(step, refill):
    """step() under torch.cuda.graph after a warm-up on a side stream; returns (graph outputs, replay)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # builds, plans, loads the kernels
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    def replay():
        refill()
        graph.replay()
        torch.cuda.synchronize()
        return captured
    return replay


def _replay_cupy(step, refill):
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()  # builds, plans, grows the workspace
        stream.synchronize()
        stream.begin_capture()
        captured = step()
        graph = stream.end_capture()

    def replay():
        with stream:
            refill()
            graph.launch(stream)
        stream.synchronize()
        return captured
    return replay


def _check(replay, fresh, poison):
    for _ in range(2):
        poison()
        got = replay()
        want = fresh()
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(_host(g), _host(w))
            assert np.isfinite(_host(g)).all()


def _outputs(case, shape, dtype, with_lse):
    """out (and lse) preallocated in the case's array type."""
    b, hq, _, lq, _, d = shape
    if case.torch:
        import torch

        out = torch.empty((b, hq, lq, d), device="cuda", dtype=getattr(torch, dtype))
        lse = torch.empty((b, hq, lq), device="cuda", dtype=torch.float32) if with_lse else None
    else:
        import cupy

        out = cupy.empty((b, hq, lq, d), dtype=numpy_dtype(dtype))
        lse = cupy.empty((b, hq, lq), dtype=cupy.float32) if with_lse else None
    return out, lse


def _poison(*arrays):
    def fill():
        for x in arrays:
            if x is not None:
                x.fill_(float("nan")) if type(x).__module__.split(".")[0] == "torch" else x.fill(np.nan)
    return fill


@pytest.mark.parametrize("library", ["torch", "cupy"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt", PREFILL)
def test_prefill_replays_equal_fresh_calls(fmt, shape, library):
    if library == "torch":
        pytest.importorskip("torch")
    dtype = _dtype(fmt)
    case = _Case(library, shape, dtype, seed=zlib.crc32(f"{fmt}{shape}".encode()))
    q, k, v = case.arrays["q"], case.arrays["k"], case.arrays["v"]
    out, lse = _outputs(case, shape, dtype, with_lse=True)
    workspace = qattn.Workspace()

    def step():
        if library == "torch":  # nothing given: the graph's pool holds out and lse
            return qattn.attention(q, k, v, format=fmt, causal=True, return_lse=True)
        return qattn.attention(q, k, v, format=fmt, causal=True, out=out, lse=lse, workspace=workspace)

    replay = (_replay_torch if library == "torch" else _replay_cupy)(step, case.refill)
    fresh = lambda: qattn.attention(q, k, v, format=fmt, causal=True, return_lse=True)  # noqa: E731
    _check(replay, fresh, _poison(out, lse) if library == "cupy" else (lambda: None))


@pytest.mark.parametrize("library", ["torch", "cupy"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_quantization_kernels_and_attention_on_their_operands(shape, library):
    """int8qk.quantize, QuantizedQKV.with_query and attention_quantized in one graph."""
    if library == "torch":
        pytest.importorskip("torch")
    from qattn.formats import int8qk

    case = _Case(library, shape, "float16", seed=7)
    q, k, v = case.arrays["q"], case.arrays["k"], case.arrays["v"]
    out, _ = _outputs(case, shape, "float16", with_lse=False)
    operands, queries = qattn.Workspace(), qattn.Workspace()
    kernel = qattn.build("prefill", format="i8-f8", head_dim=shape[5])

    def run(ws_kv=None, ws_q=None, target=None):
        qkv = int8qk.quantize(q, k, v, kernel=kernel, workspace=ws_kv)
        qkv = qkv.with_query(q, kernel=kernel, workspace=ws_q)
        return int8qk.attention_quantized(kernel, qkv, out=target)

    replay = (_replay_torch if library == "torch" else _replay_cupy)(lambda: run(operands, queries, out),
                                                                      case.refill)
    _check(replay, lambda: run(), _poison(out))


@pytest.mark.parametrize("library", ["torch", "cupy"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt", KV8)
def test_kv8_cache_write_and_attention(fmt, shape, library):
    """KVCacheInt8.write of new tokens and attention over the cache in one graph (split-K partials from
    the workspace)."""
    if library == "torch":
        pytest.importorskip("torch")
    b, hq, hkv, lq, lk, d = shape
    case = _Case(library, shape, "float32", seed=11)
    q, k, v = case.arrays["q"], case.arrays["k"], case.arrays["v"]
    cache = qattn.KVCacheInt8.from_kv(k, v)
    out, lse = _outputs(case, shape, "float32", with_lse=True)
    workspace = qattn.Workspace()

    def step():
        cache.write(k, v, 0)
        if library == "torch":
            return qattn.attention(q, cache, format=fmt, return_lse=True)
        return qattn.attention(q, cache, format=fmt, out=out, lse=lse, workspace=workspace)

    replay = (_replay_torch if library == "torch" else _replay_cupy)(step, case.refill)

    def fresh():
        cache.write(k, v, 0)
        return qattn.attention(q, cache, format=fmt, return_lse=True)
    _check(replay, fresh, _poison(out, lse) if library == "cupy" else (lambda: None))


@pytest.mark.parametrize("shape", [(3, 8, 2, 1, 700, 128), (2, 32, 8, 4, 5000, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_decode_step_under_torch_graphs_allocates_from_the_graph_pool(shape):
    """cache.write + qattn.decode with nothing preallocated (split-K partials and the output from
    the graph's pool), auto splits, speculative rows."""
    torch = pytest.importorskip("torch")
    b, hq, hkv, lq, lk, d = shape
    page = 32
    pages = -(-lk // page) + 1
    cache = qattn.PagedKVCache(b * pages, page, hkv, d, k="e4m3", v="e4m3")
    table = torch.randperm(b * pages, device="cuda", dtype=torch.int32).reshape(b, pages)
    lens = torch.tensor([lk - 17 * i for i in range(b)], dtype=torch.int32, device="cuda")
    for i in range(b):
        n = int(lens[i])
        slots = table[i, torch.arange(n, device="cuda") // page] * page + torch.arange(n, device="cuda") % page
        cache.write(torch.randn(n, hkv, d, device="cuda", dtype=torch.float16),
                    torch.randn(n, hkv, d, device="cuda", dtype=torch.float16), slots)
    new_slots = table[torch.arange(b, device="cuda"), (lens - 1) // page] * page + (lens - 1) % page
    q = torch.randn(b, hq, lq, d, device="cuda", dtype=torch.float16)
    k_new = torch.randn(b, hkv, d, device="cuda", dtype=torch.float16)
    v_new = torch.randn_like(k_new)

    def step():
        cache.write(k_new, v_new, new_slots)
        return qattn.decode(q, cache, table, lens, return_lse=True)

    def refill():
        for x in (q, k_new, v_new):
            x.copy_(torch.randn_like(x))
    replay = _replay_torch(step, refill)
    _check(replay, step, lambda: None)


def test_a_cupy_capture_without_out_or_workspace_is_refused_by_name():
    import cupy

    q = cupy.random.standard_normal((1, 2, 64, 64)).astype(cupy.float16)
    out = cupy.empty_like(q)
    qattn.attention(q, q, q, format="i8-f8")
    qattn.attention(q, q, q, format="f16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="^out: "):
                qattn.attention(q, q, q, format="f16")
            with pytest.raises(ValueError, match="^workspace: "):
                qattn.attention(q, q, q, format="i8-f8", out=out)
            with pytest.raises(ValueError, match="^workspace: .*needs"):
                qattn.attention(q, q, q, format="i8-f8", out=out, workspace=qattn.Workspace())
        finally:
            stream.end_capture()

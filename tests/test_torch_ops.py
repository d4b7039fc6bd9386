"""qattn.torch: the custom operator torch.ops.qattn.attention, its fake implementation (shapes and
dtypes without running a kernel: CPU), one graph under torch.export (CPU) and torch.compile with
fullgraph equal to eager (GPU). torch is optional: without it these skip."""
import pytest

torch = pytest.importorskip("torch")


def _block():
    import qattn.torch  # noqa: F401  (registers the operator)

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.qattn.attention(q, k, v, causal=True) * 2 + q

    return Block()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_fake_implementation_gives_the_output_shape_and_dtype(dtype):
    import qattn.torch  # noqa: F401

    dt = getattr(torch, dtype)
    q = torch.empty(2, 8, 5, 64, dtype=dt, device="meta")
    k = torch.empty(2, 2, 9, 64, dtype=dt, device="meta")
    out = torch.ops.qattn.attention(q, k, k, causal=True)
    assert out.shape == q.shape and out.dtype == dt and out.device.type == "meta"


def test_export_traces_a_model_calling_it_in_one_graph():
    q = torch.randn(1, 4, 3, 64, dtype=torch.float16)
    k = torch.randn(1, 2, 7, 64, dtype=torch.float16)
    program = torch.export.export(_block(), (q, k, k))  # traced with fake tensors: no kernel runs
    calls = [n for n in program.graph.nodes if n.op == "call_function" and n.target == torch.ops.qattn.attention.default]
    assert len(calls) == 1
    assert calls[0].args[3:5] == (None, True)  # format (the default: by q's dtype), causal


@pytest.mark.gpu
def test_compile_fullgraph_equals_eager_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q = torch.randn(2, 8, 70, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(2, 2, 300, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    block = _block()
    compiled = torch.compile(block, fullgraph=True)
    # the same kernel on the same inputs; inductor may fuse the elementwise tail in fp32 (bf16 tolerance)
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v))


def test_the_decode_fake_gives_the_output_shape_without_running():
    import qattn.torch  # noqa: F401

    q = torch.empty(3, 8, 2, 128, dtype=torch.bfloat16, device="meta")
    table = torch.empty(3, 5, dtype=torch.int32, device="meta")
    out = torch.ops.qattn.decode(q, table, table[:, 0], 12345)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "meta"


def test_a_dead_cache_handle_is_refused_by_name():
    import qattn.torch

    with pytest.raises(ValueError, match="^cache: no live"):
        qattn.torch._cache_of(10**9)
    q = torch.empty(1, 2, 1, 64)
    with pytest.raises(TypeError, match="^cache: expected a qattn.PagedKVCache"):
        qattn.torch.decode(q, object(), q, q)


@pytest.mark.gpu
def test_compiled_decode_equals_eager_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import qattn
    import qattn.torch

    cache = qattn.PagedKVCache(16, 32, 2, 128, k="e4m3", v="e4m3")
    k = torch.randn(400, 2, 128, device="cuda", dtype=torch.float16)
    cache.write(k, torch.randn_like(k), torch.arange(400, device="cuda"))
    table = torch.arange(16, dtype=torch.int32, device="cuda").reshape(2, 8)
    lens = torch.tensor([230, 256], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.float16)

    def step(q):
        return qattn.torch.decode(q, cache, table, lens) * 2 + q

    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(q), step(q))

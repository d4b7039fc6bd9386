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

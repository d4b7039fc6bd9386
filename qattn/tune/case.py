"""One shape of a sweep on the GPU: its inputs, the FP64 reference of their first heads, and the
check that each candidate runs right before it is timed."""
from __future__ import annotations

from dataclasses import dataclass

from ..check import metrics
from ..engine.family import Tolerance
from ..engine.shape_class import ShapeClass
from .sweep import Rejected


@dataclass(frozen=True)
class Shape:
    """What a sweep times: q [batch, heads, queries, D], k and v [batch, kv_heads, keys, D]."""

    batch: int
    heads: int
    kv_heads: int
    queries: int
    keys: int

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"shape: {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads: {self.heads} is not a multiple of kv_heads {self.kv_heads}")

    @property
    def shape_class(self) -> ShapeClass:
        return ShapeClass.of(self.queries, self.keys, self.heads, self.kv_heads, batch=self.batch)

    @property
    def label(self) -> str:
        lengths = str(self.keys) if self.queries == self.keys else f"{self.queries}/{self.keys}"
        return f"{self.batch}x{lengths} H{self.heads}/{self.kv_heads}"


def output_problem(out, full_nonfinite: int, reference, tolerance: Tolerance) -> str | None:
    """Why a candidate's output is wrong, or None: elements left unwritten or non-finite anywhere
    (full_nonfinite, counted over a NaN-poisoned output), or the checked slice (out, against
    reference) outside the format's tolerance of FP64."""
    if full_nonfinite:
        return f"{full_nonfinite} outputs not written or not finite"
    err = metrics.compare(out, reference)
    if not err.max_rel <= tolerance.max_rel:
        return f"max_rel {err.max_rel:.2e} over the format's {tolerance.max_rel:.0e}"
    if not err.rel_l2 <= tolerance.rel_l2:
        return f"rel_l2 {err.rel_l2:.2e} over the format's {tolerance.rel_l2:.0e}"
    return None


class GpuCase:
    """N(0,1) inputs of one shape in the format's dtype and the FP64 attention of their first heads;
    calling it with a candidate spec launches the candidate once into a NaN-poisoned output, checks
    it (output_problem) and returns the launch to time, or raises Rejected."""

    def __init__(self, fmt: str, head_dim: int, causal: bool, shape: Shape, seed: int = 0):
        import cupy

        from ..bench.prefill import format_inputs, fp64_slice
        from ..engine.registry import recipe

        rng = cupy.random.default_rng(seed)
        q, k, v = (rng.standard_normal((shape.batch, heads, length, head_dim), dtype=cupy.float32).astype(cupy.float16)
                   for heads, length in ((shape.heads, shape.queries), (shape.kv_heads, shape.keys),
                                         (shape.kv_heads, shape.keys)))
        self.inputs = format_inputs(fmt, q, k, v)
        self.reference = fp64_slice(*self.inputs, causal)
        self.tolerance = recipe(fmt).tolerance
        self.out = cupy.empty_like(self.inputs[0])

    def __call__(self, spec):
        import cupy

        from ..engine.kernel import build_kernel

        kernel = build_kernel(spec)  # compiled beforehand (build.prebuild): loaded from the cache
        inputs, out = self.inputs, self.out
        out.fill(float("nan"))
        try:
            kernel(*inputs, out=out)
            cupy.cuda.get_current_stream().synchronize()
        except (cupy.cuda.driver.CUDADriverError, cupy.cuda.runtime.CUDARuntimeError) as exc:
            raise Rejected(f"launch: {exc}") from None
        checked = out[0, :self.reference.shape[0]]
        nonfinite = int((~cupy.isfinite(out.astype(cupy.float32, copy=False))).sum())  # fp32: a dtype every ufunc takes
        problem = output_problem(checked, nonfinite, self.reference, self.tolerance)
        if problem:
            raise Rejected(problem)
        return lambda: kernel(*inputs, out=out)

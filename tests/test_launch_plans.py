"""The int8-QK call's launch plans on the CPU: the per-kernel cache, and where a QuantPlan puts
each operand (the functions are stand-ins; nothing launches)."""
from collections import OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest

from qattn.engine.spec import KernelSpec
from qattn.formats.int8qk import launch as int8_launch
from qattn.engine import packed
from qattn.engine.packed import NULL, Pointer


def test_plans_are_cached_per_key_and_bounded():
    kernel = SimpleNamespace(plans=OrderedDict())
    built = []

    def build(key):
        built.append(key)
        return ("plan", key)

    limit = packed.PLANS_PER_KERNEL
    for key in range(limit + 1):
        assert packed.cached_plan(kernel, key, lambda key=key: build(key)) == ("plan", key)
    assert len(kernel.plans) == limit and 0 not in kernel.plans  # the least recently used went
    assert packed.cached_plan(kernel, 1, lambda: build("again")) == ("plan", 1)
    assert built[-1] == limit and next(reversed(kernel.plans)) == 1  # a hit builds nothing, moves last


def test_a_failed_build_caches_nothing():
    kernel = SimpleNamespace(plans=OrderedDict())

    def bad():
        raise ValueError("q: bad")

    with pytest.raises(ValueError, match="q: bad"):
        packed.cached_plan(kernel, "key", bad)
    assert not kernel.plans


def _stand_in(recipe, head_dim, mma=None, options=None):
    spec = KernelSpec(kind="prefill", recipe=recipe, head_dim=head_dim, arch="sm_90a", mma=mma, options=options or {})
    return SimpleNamespace(spec=spec, function=lambda suffix: SimpleNamespace(ptr=1), threads=256, shared_bytes=0)


def _contiguous(shape, itemsize=2):
    return tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))


@pytest.mark.parametrize("recipe,dtype,smoothing", [("i8-f8", "float16", "mean"), ("i8-f8", "bfloat16", None),
                                                    ("i8-f16", "float16", "mean"), ("i8-f16", "float16", None),
                                                    ("i8-i8", "bfloat16", "mean"), ("i8-f8", "bfloat16", "mean+balance"),
                                                    ("i8-f16", "float16", "mean+balance"),
                                                    ("i8-f16", "bfloat16", "mean"), ("i8-f16+v_tiles=on", "float16", "mean"),
                                                    ("i8-f16+broadcast", "float16", "mean"),
                                                    ("i8-f16@mma.sync", "float16", "mean")])
def test_quant_plan_places_every_operand_apart(recipe, dtype, smoothing):
    b, hq, hkv, lq, lk, d = 2, 8, 2, 300, 1029, 128
    recipe, _, variant = recipe.partition("+")
    recipe, _, mma = recipe.partition("@")
    kernel = _stand_in(recipe, d, mma or None, {"v_tiles": "on"} if variant == "v_tiles=on" else None)
    q_shape, kv_shape = (b, hq, lq, d), (b, hkv, lk, d)
    v_strides = (0,) + _contiguous(kv_shape)[1:] if variant == "broadcast" else _contiguous(kv_shape)
    plan = int8_launch.QuantPlan(kernel, (b, hq, hkv, lq, lk, d), dtype,
                                 (_contiguous(q_shape), _contiguous(kv_shape), v_strides), 0.125, True, smoothing)
    spans = sorted((buf.offset, buf.offset + int(np.prod(buf.shape)) * np.dtype(buf.dtype).itemsize, name)
                   for name, buf in plan.buffers.items())
    for (start, end, name), (next_start, _, next_name) in zip(spans, spans[1:]):
        assert start % 256 == 0 and end <= next_start, (name, next_name)
    assert spans[-1][1] <= plan.nbytes
    bn = kernel.spec.tile.block_n
    lk_pad = -(-lk // bn) * bn
    tiled = kernel.spec.family.values["mma_unit"] == "wgmma"
    assert plan.buffers["k8"].shape == (b, hkv, lk_pad if tiled else lk, d)
    assert plan.buffers["q8"].shape == q_shape and plan.buffers["shift"].shape == (b, hq, lq)
    operands = plan.operands()
    # fp16 V for the fp16 PV: read as given, by the wgmma kernel's TMA where it can address V's strides (with v_tiles
    # "on" the quantizer copies V into swizzled tiles); bf16 V, or V broadcast over the batch, as fp16 rows
    v_tiles = tiled and variant == "v_tiles=on"
    passes_v = recipe == "i8-f16" and dtype == "float16" and not v_tiles and variant != "broadcast"
    assert ("v_op" in plan.buffers) != passes_v
    if recipe == "i8-f16" and not passes_v:  # fp16 V tiles of block_n keys (the tail padded), or rows
        assert plan.buffers["v_op"].shape == (b, hkv, lk_pad if v_tiles else lk, d)
    assert operands["v"] == (Pointer("v") if passes_v else Pointer("ws", plan.buffers["v_op"].offset))
    # the wgmma i8-f16 kernel's V map: over the caller's V, or over the quantizer's rows
    assert (plan.v_map is not None) == (recipe == "i8-f16" and tiled and not v_tiles)
    if plan.v_map is not None:  # both contiguous here: rows of 2d bytes, 64-channel lines of 128
        row = 2 * d
        assert plan.v_map.spec.dims == (64, lk, d // 64, hkv, b)
        assert plan.v_map.spec.strides == (row, 128, lk * row, hkv * lk * row)
        assert plan.v_map.spec.box == (64, bn, d // 64, 1, 1)
    assert (operands["v_out_scale"] == NULL) == (recipe == "i8-f16")
    # K̄ is zero-filled only where no statistics compute it
    assert (plan.zero_fill is not None) == (smoothing is None and recipe == "i8-f16")
    assert ("part_sum" in plan.buffers) == (smoothing is not None)
    balance = smoothing == "mean+balance"
    assert all((name in plan.buffers) == balance for name in ("alpha", "part_range", "part_qmax"))
    if balance:
        nchunks = -(-lk // int8_launch.COLSTATS_CHUNK)
        assert plan.buffers["alpha"].shape == (b, hkv, d)
        assert plan.buffers["part_range"].shape == (2, b, hkv, nchunks, d)
        assert plan.buffers["part_qmax"].shape == (b, hq, -(-lq // int8_launch.COLSTATS_CHUNK), d)


@pytest.mark.parametrize("smoothing,entries", [
    ("mean", ["_stats_f16", "_stats_finish", "_quant_qkv_f16"]),
    (None, ["_stats_f16", "_stats_finish", "_quant_qkv_f16"]),  # i8-f8: V's statistics all the same
    ("mean+balance", ["_stats_balance_f16", "_stats_f16", "_stats_finish", "_balance", "_quant_qkv_balance_f16"])])
def test_quant_plan_launches_balancing_only_when_asked(smoothing, entries):
    """The balancing entries (K's range, Q's absmax, α, codes of q̃·α and K̃ / α) run with
    smoothing="mean+balance" only; the others launch what they launched before."""
    b, hq, hkv, lq, lk, d = 1, 4, 1, 130, 700, 128
    named = []
    kernel = _stand_in("i8-f8", d)
    kernel.function = lambda suffix: named.append(suffix) or SimpleNamespace(ptr=1)
    int8_launch.QuantPlan(kernel, (b, hq, hkv, lq, lk, d), "float16",
                          (_contiguous((b, hq, lq, d)), _contiguous((b, hkv, lk, d)), _contiguous((b, hkv, lk, d))),
                          0.125, True, smoothing)
    assert named == entries


@pytest.mark.parametrize("recipe,arch,expected", [("i8-f8", "sm_90a", True), ("i8-f8", "sm_120", True),
                                                  ("i8-f8", "sm_89", False), ("i8-f16", "sm_80", False)])
def test_launches_are_programmatic_from_sm90(monkeypatch, recipe, arch, expected):
    monkeypatch.setattr(packed, "_launch_kernel_ex", lambda: lambda *args: 0)
    spec = KernelSpec(kind="prefill", recipe=recipe, head_dim=64, arch=arch)
    kernel = SimpleNamespace(spec=spec, function=lambda suffix: SimpleNamespace(ptr=1), threads=256, shared_bytes=0)
    dims, shape = (1, 2, 2, 100, 100, 64), (1, 2, 100, 64)
    plan = int8_launch.QuantPlan(kernel, dims, "float16", (_contiguous(shape),) * 3, 0.125, False, True)
    attention = int8_launch.attention_launch(kernel, dims, "float16", plan.operands(), _contiguous(shape),
                                             _contiguous(shape), False, 0)
    assert [launch.programmatic for launch in plan.launches + [attention]] == [expected] * 4


def test_int8_attention_grid_runs_over_work_items_on_wgmma(monkeypatch):
    """The wgmma int8-QK kernels take a flat grid of their work items (query blocks x heads x batch), with
    persistent "on" as many blocks as the SMs hold (causal: one a pair of items); the mma.sync kernel keeps
    its (query blocks, heads, batch) grid. The batch is the kernel's argument after the output strides."""
    from qattn.engine import grid
    from qattn.engine.tile import Tile

    monkeypatch.setattr(packed, "_launch_kernel_ex", lambda: lambda *args: 0)
    monkeypatch.setattr(grid, "sm_count", lambda device_id: 132)
    dims, shape = (2, 8, 2, 8192, 8192, 128), (2, 8, 8192, 128)

    def launch_grid(arch="sm_90a", recipe="i8-f8", **spec_args):
        spec = KernelSpec(kind="prefill", recipe=recipe, head_dim=128, arch=arch, **spec_args)
        kernel = SimpleNamespace(spec=spec, function=lambda suffix: SimpleNamespace(ptr=1), threads=256, shared_bytes=0)
        plan = int8_launch.QuantPlan(kernel, dims, "float16", (_contiguous(shape),) * 3, 0.125, False, True)
        return int8_launch.attention_launch(kernel, dims, "float16", plan.operands(), _contiguous(shape),
                                            _contiguous(shape), False, 0)._dims[:3]

    assert launch_grid() == (43 * 8 * 2, 1, 1)  # ceil(8192 / 192) query blocks
    assert launch_grid(causal=True) == (43 * 8 * 2, 1, 1)
    assert launch_grid(options={"persistent": "on"}) == (132, 1, 1)
    assert launch_grid(tile=Tile(64, 128, 4, 2), options={"persistent": "on"}) == (264, 1, 1)  # two blocks an SM
    assert launch_grid(recipe="i8-f16", causal=True, options={"persistent": "on"}) == (132, 1, 1)
    assert launch_grid(arch="sm_80", recipe="i8-f16") == (64, 8, 2)  # 128-row blocks
    with pytest.raises(ValueError, match="persistent"):
        KernelSpec(kind="prefill", recipe="i8-f16", head_dim=128, arch="sm_80", options={"persistent": "on"})


@pytest.mark.parametrize("fmt,splits", [("kv8-imma", 1), ("kv8-imma", 5), ("kv8-split", 3), ("kv8-f32", 1)])
def test_kv8_plan_launches_and_workspace(monkeypatch, fmt, splits):
    from qattn.formats.kv8 import launch as kv8_launch

    monkeypatch.setattr(packed, "_launch_kernel_ex", lambda: lambda *args: 0)
    b, hq, hkv, lq, lk, d = 2, 8, 2, 300, 1029, 128
    spec = KernelSpec(kind="prefill", recipe=fmt, head_dim=d, arch="sm_90a")
    entries = []

    def function(suffix=""):
        entries.append(suffix)
        return SimpleNamespace(ptr=1)

    kernel = SimpleNamespace(spec=spec, function=function, threads=128, shared_bytes=0)
    q_st = packed.element_strides(_contiguous((b, hq, lq, d), 4), 4)
    codes = packed.element_strides(_contiguous((b, hkv, 4096, d), 1), 1)
    scales = packed.element_strides(_contiguous((b, hkv, 4096), 4), 4)
    plan = kv8_launch.Kv8Plan(kernel, (b, hq, hkv, lq, lk, d), (q_st, codes, scales, codes, scales, q_st), True,
                              0.125, splits)
    mma = fmt != "kv8-f32"
    want = (["_stat"] if mma else []) + [""] + (["_merge"] if splits > 1 else [])
    assert entries == want and len(plan.launches) == len(want)
    assert all(launch.programmatic for launch in plan.launches)
    floats = (b * hq * (d // 64 + 1) if mma else 0, splits * b * hq * lq * d if splits > 1 else 0,
              splits * b * hq * lq * 2 if splits > 1 else 0)
    assert plan.nbytes == sum(-(-4 * n // 256) * 256 for n in floats)
    assert plan.lse_shape == (b, hq, lq)

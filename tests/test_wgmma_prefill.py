"""f16, bf16 and i8-f16 prefill on the shared warp-specialized wgmma pipeline (sm_90a;
templates/cuda/wgmma_attention.cuh.j2), on a machine with no GPU: which kernel a spec selects, the
families' tile rules, and every default spec compiled for sm_90a with its warpgroup MMAs of the
right types, unserialized, in registers, behind the producer's mbarriers (the GPU half:
tests/test_gpu_wgmma_prefill.py)."""
from __future__ import annotations

import functools
from collections import Counter

import pytest
from conftest import check_grid_dependency, check_spills, entry_ptx

from qattn.engine import packed
from qattn.engine.compile import compile_cuda, disassemble, entry_resources
from qattn.engine.inspect import warpgroup_mmas
from qattn.engine.registry import recipe
from qattn.engine.render import entry_name, render
from qattn.engine import registry
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile
from qattn.formats.int8qk import host as int8

FORMATS = ("f16", "bf16", "i8-f16")
SPECS = [KernelSpec(recipe=f, head_dim=d, causal=c, arch="sm_90a", mma="wgmma") for f in FORMATS
         for d in (64, 128) for c in (False, True)]
# other valid tiles: one and three consumer warpgroups, 64- to 192-key blocks, a deeper ring (d128's m192n64
# and m64n128 fit the consumers' registers since the TMA producer keeps 24)
OTHER_TILES = [KernelSpec(recipe=f, head_dim=d, causal=c, arch="sm_90a", mma="wgmma", tile=Tile(*t))
               for f, d, c, t in (("f16", 64, False, (192, 64, 12, 2)), ("bf16", 64, True, (64, 128, 4, 2)),
                                  ("f16", 128, True, (128, 64, 8, 3)), ("i8-f16", 64, True, (128, 64, 8, 2)),
                                  ("bf16", 128, True, (192, 64, 12, 3)), ("f16", 128, False, (64, 128, 4, 2)),
                                  ("i8-f16", 128, True, (128, 160, 8, 2)), ("i8-f16", 128, False, (128, 192, 8, 2)))]
# the kernels calls are routed to by their query rows (recipes.LAUNCH_TILES: persistent blocks, three consumer
# warpgroups at d64), each (tile, options) once
ROUTED = list(dict.fromkeys(
    KernelSpec(recipe=f, head_dim=d, causal=c, arch="sm_90a", mma="wgmma", tile=choice.tile, options=dict(choice.options))
    for f in FORMATS for d in (64, 128) for c in (False, True) for choice in registry.launch_choices(f, d, "sm_90a", c)))
# the f16 / bf16 kernels with K and V rows gathered by cp.async (the TMA launch's fallback)
KV_ROWS = [KernelSpec(recipe=f, head_dim=d, causal=c, arch="sm_90a", mma="wgmma", options={"kv_rows": "on"})
           for f, d, c in (("f16", 128, False), ("bf16", 64, True))]
# the consumer warpgroups issuing their MMAs in turns (two, and three)
PINGPONG = [KernelSpec(recipe=f, head_dim=d, causal=c, arch="sm_90a", mma="wgmma", tile=Tile(*t),
                       options={"pingpong": "on"})
            for f, d, c, t in (("f16", 128, False, (128, 128, 8, 2)), ("bf16", 64, True, (192, 64, 12, 2)),
                               ("f16", 128, True, (128, 160, 8, 2)), ("bf16", 128, False, (128, 144, 8, 2)),
                               ("i8-f16", 128, True, (128, 64, 8, 3)), ("i8-f16", 64, False, (192, 64, 12, 2)))]


@functools.lru_cache(maxsize=None)
def _compiled(spec: KernelSpec):
    return compile_cuda(render(spec), spec.arch, spec.name)


def _attention_entry(spec: KernelSpec) -> str:
    return entry_name(spec) + spec.family.main_entry


# ---- selection ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_sm90a_defaults_follow_the_measurements_and_both_units_are_selectable(fmt):
    """On sm_90a the f16 and bf16 specs keep the mma.sync kernel by default (calls take the wgmma one by
    their query rows, recipes.LAUNCH_TILES: it loses below 512-1024 rows, docs/notes/dense.md) and
    i8-f16 takes wgmma; the other unit is selectable by name."""
    default_unit = "wgmma" if fmt == "i8-f16" else "mma.sync"
    for d in (64, 128):
        default = KernelSpec(recipe=fmt, head_dim=d, arch="sm_90a")
        assert default.family.values["mma_unit"] == default_unit
        spelled = KernelSpec(recipe=fmt, head_dim=d, arch="sm_90a", mma=default_unit)
        assert spelled == default and spelled.key == default.key  # the default unit, spelled out
        wgmma = KernelSpec(recipe=fmt, head_dim=d, arch="sm_90a", mma="wgmma")
        assert wgmma.family.producer_warps == 4 and wgmma.family.threads(wgmma.tile) == 32 * wgmma.tile.warps + 128
        sync = KernelSpec(recipe=fmt, head_dim=d, arch="sm_90a", mma="mma.sync")
        assert sync.family.values["mma_unit"] == "mma.sync" and sync.family is recipe(fmt).family("cuda")
        assert sync.key != wgmma.key
    for arch in ("sm_80", "sm_89", "sm_90", "sm_120"):  # the mma.sync kernel stays everywhere else
        if arch in recipe(fmt).family("cuda").archs:
            assert KernelSpec(recipe=fmt, head_dim=128, arch=arch).family is recipe(fmt).family("cuda")
            with pytest.raises(ValueError, match="mma: "):
                KernelSpec(recipe=fmt, head_dim=128, arch=arch, mma="wgmma")


def test_head_dims_without_a_wgmma_kernel_keep_mma_sync():
    for d in (32, 96):
        spec = KernelSpec(recipe="f16", head_dim=d, arch="sm_90a")
        assert spec.family.values["mma_unit"] == "mma.sync" and spec.mma is None
        assert spec == KernelSpec(recipe="f16", head_dim=d, arch="sm_90a", mma="mma.sync")
        with pytest.raises(ValueError, match="head_dim: f16 on wgmma"):
            KernelSpec(recipe="f16", head_dim=d, arch="sm_90a", mma="wgmma")


def test_d256_calls_from_256_rows_run_wgmma():
    """D = 256 has a wgmma kernel (128 x 64 tiles, the output staged over Q's rows): calls of 256 query rows and
    more run it (1.5x the mma.sync kernel at L256, 3.4x at L4096 on the H100), causal ones with persistent blocks;
    shorter ones the mma.sync kernel, which stays the spec's default. One consumer warpgroup cannot compile O's 128
    registers a thread at launch."""
    from qattn.formats.dense.recipes import wgmma_stages_over_q

    for fmt in ("f16", "bf16"):
        spec = KernelSpec(recipe=fmt, head_dim=256, arch="sm_90a")
        assert spec.family.values["mma_unit"] == "mma.sync"
        for causal in (False, True):
            assert registry.launch_choice(fmt, 256, "sm_90a", 255, causal) is None
            choice = registry.launch_choice(fmt, 256, "sm_90a", 256, causal)
            blocks = (("persistent", "on"),) if causal else ()  # causal items in pairs of a heavy and a light block
            assert (choice.mma, choice.tile, choice.options) == ("wgmma", Tile(128, 64, 8, 2), blocks)
        wgmma = KernelSpec(recipe=fmt, head_dim=256, arch="sm_90a", mma="wgmma")
        assert wgmma.tile == Tile(128, 64, 8, 2) and wgmma_stages_over_q(wgmma.tile, 256)
        assert wgmma.family.smem_bytes(wgmma.tile, 256) == 128 * 512 + 2 * 2 * 64 * 512 + 64
    with pytest.raises(ValueError, match="two or more consumer warpgroups"):
        KernelSpec(recipe="f16", head_dim=256, arch="sm_90a", mma="wgmma", tile=Tile(64, 64, 4, 2))
    with pytest.raises(ValueError, match="registers a consumer thread"):
        KernelSpec(recipe="f16", head_dim=256, arch="sm_90a", mma="wgmma", tile=Tile(128, 112, 8, 2))


def test_default_tiles_and_tile_rules():
    for fmt in ("f16", "bf16"):
        fam = KernelSpec(recipe=fmt, head_dim=128, arch="sm_90a", mma="wgmma").family
        assert fam.default_tiles == {64: Tile(128, 128, 8, 2), 128: Tile(128, 128, 8, 2), 256: Tile(128, 64, 8, 2)}
        assert fam.smem_bytes(Tile(128, 128, 8, 2), 128) == 128 * 256 + 2 * 2 * 128 * 256 + 128 * 136 * 2 + 64
    fam = KernelSpec(recipe="i8-f16", head_dim=128, arch="sm_90a", mma="wgmma").family
    assert fam.default_tiles == {64: Tile(128, 128, 8, 2), 128: Tile(128, 128, 8, 2)}
    assert fam.values == {"pv_operand": "f16", "mma_unit": "wgmma", "q_scale_rows": 1, "k_scale_groups": 4,
                          "pingpong": "on", "v_tiles": "off", "persistent": "off"}  # d128 takes turns (option_defaults)
    assert dict(KernelSpec(recipe="i8-f16", head_dim=64, arch="sm_90a").options) == {"pingpong": "off", "v_tiles": "off",
                                                                                      "persistent": "off"}
    # i8-f16's Q8/K8 rows of D bytes, fp16 V rows of 2D
    assert fam.smem_bytes(Tile(128, 64, 8, 3), 128) == 128 * 128 + 3 * (64 * 128 + 64 * 256) + 128 * 136 * 2 + 96
    for fmt in FORMATS:
        for tile, why in ((Tile(128, 64, 4, 2), "block_m must be 64, 128 or 192"),
                          (Tile(256, 64, 16, 2), "block_m must be 64, 128 or 192"),
                          (Tile(128, 32, 8, 2), "block_n must be"),
                          (Tile(192, 128, 12, 2), "registers a consumer thread"),
                          (Tile(128, 64, 8, 5), "stages must be 2..4")):
            with pytest.raises(ValueError, match=why):
                KernelSpec(recipe=fmt, head_dim=128, arch="sm_90a", mma="wgmma", tile=tile)


def test_i8_f16_scale_blocks_follow_the_kernel():
    """The wgmma i8-f16 kernel takes i8-f8's scale layout (one Q scale per row, four K scale groups
    per key tile), its K8 as wgmma tiles and V as fp16 rows: the emulator options and the
    quantizer's layouts follow the spec."""
    from qattn.formats.int8qk.launch import tile_keys

    spec = KernelSpec(recipe="i8-f16", head_dim=128, arch="sm_90a", mma="wgmma")
    assert int8.emulator_options(spec) == {"block_m": 1, "block_n": 128, "k_granularity": "thread"}
    assert tile_keys(spec) == 128
    sync = KernelSpec(recipe="i8-f16", head_dim=128, arch="sm_90a", mma="mma.sync")
    assert tile_keys(sync) == 0 and int8.emulator_options(sync)["block_m"] == sync.tile.block_m

# persistent blocks that run their items back to back (chain on, two consumer warpgroups, TMA K/V), Q rows by the
# consumers' cp.async (q_tma, d128's default, has its own test)
CHAINED = [KernelSpec(recipe=f, head_dim=d, causal=c, arch="sm_90a", mma="wgmma",
                      options={"persistent": "on", "chain": "on", "q_tma": "off"})
           for f, d, c in (("f16", 128, False), ("bf16", 128, True), ("f16", 64, True))]


# ---- NVRTC compile ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS + OTHER_TILES + ROUTED + KV_ROWS + PINGPONG + CHAINED, ids=lambda s: s.name)
def test_compiles_on_warpgroup_mmas(spec):
    binary = _compiled(spec)
    entry = _attention_entry(spec)
    # in registers: the default tiles (and the other valid tiles here) spill nothing; the cp.async rows
    # producer (the fallback for strides the TMA cannot read) keeps its work-item counter on the stack
    # across each item's unrolled row copies (4 bytes stored and loaded once per item)
    rows = spec.family.values.get("kv_rows") == "on"
    measured = ((spec.head_dim, spec.causal, spec.arch) in spec.family.measured_spills
                and spec.tile == spec.family.default_tile(spec.head_dim, spec.causal, spec.arch))
    allowed = 8 if rows else 64 if measured else 0
    check_spills(entry, entry_resources(binary.log, entry), attention=True, allowed=allowed)
    if spec.recipe == "i8-f16":  # the quantization kernels too
        for suffix in int8.module_entries(spec.recipe, spec.backend):
            if suffix not in ("_f16", "_bf16"):
                check_spills(suffix, entry_resources(binary.log, entry_name(spec) + suffix), attention=False)
    # ptxas serializes every wgmma of a kernel when it cannot prove their registers untouched while
    # in flight (advisory C7514): the kernel still runs, at a fraction of its speed
    assert "C7514" not in binary.log and "serialized" not in binary.log, binary.log
    ptx = binary.ptx
    attn = entry_ptx(ptx, entry)
    bn, d = spec.tile.block_n, spec.head_dim
    # K and V by one copy a tile from one producer thread: TMA boxes (dense), the quantizer's tiles (i8-f16)
    bulk = spec.family.values.get("kv_rows") == "off" or spec.recipe == "i8-f16"
    if spec.recipe == "i8-f16":
        assert f"wgmma.mma_async.sync.aligned.m64n{bn}k32.s32.s8.s8" in attn
        assert f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.f16.f16" in attn
        # K8 and fp16 V tiles: one bulk copy each (V in 128-byte swizzled lines: swizzle mode bit 30 of
        # the descriptor's high word)
        assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in attn
        assert "mbarrier.arrive.expect_tx" in attn and "1073741888" in attn  # (1 << 30) | (1024 >> 4)
    else:
        t = spec.recipe
        assert f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{t}.{t}" in attn  # S = Q Kᵀ
        assert f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.{t}.{t}" in attn  # O += P V
        if bulk:  # K and V: one 5-d TMA box a tile by one thread, completing by bytes; maps prefetched
            assert "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in attn
            # (a third: the chained items' output boxes, or their Q boxes)
            tma_rows = any(dict(spec.options).get(o) == "on" for o in ("out_tma", "q_tma"))
            assert "mbarrier.arrive.expect_tx" in attn and attn.count("prefetch.tensormap") == 2 + tma_rows
            assert ".param .align 64 .b8" in attn  # the maps, by value
        else:
            assert "cp.async.bulk" not in attn and "tensormap" not in attn
    assert "mma.sync" not in attn and "ldmatrix" not in attn and "e4m3" not in attn
    # P V with V N-major: the register-A form with imm-trans-b 1
    assert "p, 1, 1, 1;" in attn
    # Q by the consumers (but for chained items' Q boxes by TMA, q_tma) and K/V rows by the producer (but for bulk
    # copies): cp.async, fenced for the async proxy before the barrier that publishes them; mbarrier waits;
    # registers handed over
    q_by_tma = dict(spec.options).get("q_tma") == "on"
    assert ("cp.async.cg.shared.global" in attn) == (not (q_by_tma and bulk))
    assert ("cp.async.wait_group 1" in attn) == (not bulk)
    assert "fence.proxy.async.shared::cta" in attn and "mbarrier.try_wait.parity" in attn
    assert "mbarrier.arrive.shared::cta.b64" in attn and "fence.mbarrier_init.release.cluster" in attn
    assert f"setmaxnreg.dec.sync.aligned.u32 {24 if bulk else 56}" in attn and "setmaxnreg.inc.sync.aligned.u32" in attn
    # S of the next tile runs ahead of PV (QK_AHEAD): waits with one group in flight and with none
    assert "wgmma.wait_group.sync.aligned 1;" in attn and "wgmma.wait_group.sync.aligned 0;" in attn
    # turns between consumer warpgroups: bar.arrive on the next one's barrier, only with pingpong on
    # (one consumer warpgroup has no one to take turns with)
    assert ("bar.arrive" in attn) == (spec.family.values.get("pingpong") == "on" and spec.tile.warps > 4), spec.name
    check_grid_dependency(ptx, entry, packed.programmatic(spec))
    # every warpgroup MMA of the PTX reaches the SASS as a product, none as a placeholder onto RZ
    wgmma = warpgroup_mmas(ptx, disassemble(binary.data, "cuda"))
    assert wgmma["sass"] == wgmma["ptx"] > 0 and wgmma["placeholders"] == 0, wgmma


@pytest.mark.parametrize("spec", CHAINED, ids=lambda s: s.name)
def test_chained_items_issue_a_third_step(spec):
    """Chained items: beside a work item's first S and the key loop's S-ahead step (S and P V) comes the step
    that ends one item and begins the next (its last P V and the next item's first S), and the key loop's last
    P V alone stays for a block's last item; without chain, two sites of each."""
    from qattn.formats.dense.recipes import wgmma_chains

    plain = spec.with_(options={**dict(spec.options), "chain": "off"})
    assert wgmma_chains(spec.tile, spec.head_dim, dict(spec.options)) and "chain" in spec.name
    bn, d, t = spec.tile.block_n, spec.head_dim, spec.recipe
    for s, sites in ((spec, 3), (plain, 2)):
        attn = entry_ptx(_compiled(s).ptx, _attention_entry(s))
        expected = Counter({bn: sites * d // 16}) + Counter({d: sites * bn // 16})  # S: n = BN, k = D; P V: n = D
        for n, count in expected.items():
            assert attn.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t}") == count, (s.name, n)


@pytest.mark.parametrize("spec", CHAINED, ids=lambda s: s.name)
def test_chained_rows_by_tma_stores(spec):
    """out_tma "on": a chained kernel stages each warp's 16 output rows as the box of a TMA store of a third map (a
    kernel parameter by value, prefetched), waits for the stores' reads before the next but one item's Q rows land
    over them and for the stores themselves before the block ends, and writes no output row with its own stores;
    its products are the chained kernel's, and ptxas spills nothing and serializes no wgmma."""
    on = spec.with_(options={**dict(spec.options), "out_tma": "on"})
    assert "outtma" in on.name and "outtma" not in spec.name
    binary = _compiled(on)
    entry = _attention_entry(on)
    check_spills(entry, entry_resources(binary.log, entry), attention=True)
    assert "C7514" not in binary.log and "serialized" not in binary.log, binary.log
    attn, plain = entry_ptx(binary.ptx, entry), entry_ptx(_compiled(spec).ptx, _attention_entry(spec))
    assert "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group" in attn and "cp.async.bulk.commit_group" in attn
    assert "cp.async.bulk.wait_group.read 0" in attn and "cp.async.bulk.wait_group 0" in attn
    assert attn.count("prefetch.tensormap") == 3 and attn.count(".param .align 64 .b8") == 3
    assert "st.global.v4" not in attn and "st.global.v4" in plain  # the rows: TMA stores instead of the warps' own
    assert "cp.async.bulk.tensor.5d.global" not in plain
    t = spec.recipe
    for n in {spec.tile.block_n, spec.head_dim}:
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t}"
        assert attn.count(op) == plain.count(op) > 0


@pytest.mark.parametrize("spec", CHAINED, ids=lambda s: s.name)
def test_chained_q_rows_by_the_producers_tma(spec):
    """q_tma "on": the producer loads each item's BM Q rows as one box of a third map into the item's region, and the
    consumers issue no cp.async; the products are the chained kernel's, and ptxas spills nothing."""
    on = spec.with_(options={**dict(spec.options), "q_tma": "on"})
    assert (on == spec.with_(options={"persistent": "on", "chain": "on"})) == (spec.head_dim == 128)  # d128's default
    binary = _compiled(on)
    entry = _attention_entry(on)
    check_spills(entry, entry_resources(binary.log, entry), attention=True)
    assert "C7514" not in binary.log and "serialized" not in binary.log, binary.log
    attn, plain = entry_ptx(binary.ptx, entry), entry_ptx(_compiled(spec).ptx, _attention_entry(spec))
    assert "cp.async.cg.shared.global" not in attn and "cp.async.cg.shared.global" in plain
    assert attn.count("prefetch.tensormap") == 3 and attn.count(".param .align 64 .b8") == 3
    t = spec.recipe
    for n in {spec.tile.block_n, spec.head_dim}:
        op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t}"
        assert attn.count(op) == plain.count(op) > 0


@pytest.mark.parametrize("tile,options", [((128, 128, 8, 2), {}), ((128, 128, 8, 2), {"persistent": "on"}),
                                          ((128, 128, 8, 2), {"persistent": "on", "kv_rows": "on", "chain": "on"}),
                                          ((128, 176, 8, 2), {"persistent": "on", "chain": "on"})])
def test_tma_options_settle_off_where_no_items_chain(tile, options):
    """out_tma and q_tma "on" where items do not chain (a block an item, persistent without chain, the cp.async
    producer, a tile that stages its output over Q) take no effect: the spec is the one without them."""
    on = KernelSpec(recipe="f16", head_dim=128, arch="sm_90a", mma="wgmma", tile=Tile(*tile),
                    options={**options, "out_tma": "on", "q_tma": "on"})
    off = on.with_(options={**options, "out_tma": "off", "q_tma": "off"})
    assert on == off and "tma" not in on.name


@pytest.mark.parametrize("tile,options", [((128, 128, 8, 2), {}), ((128, 128, 8, 2), {"persistent": "on", "kv_rows": "on"}),
                                          ((192, 128, 12, 2), {"persistent": "on"}),
                                          ((128, 176, 8, 2), {"persistent": "on"}), ((64, 128, 4, 2), {"persistent": "on"})])
def test_chain_changes_nothing_where_there_is_nothing_to_chain(tile, options):
    """chain "on" on a block an item, the cp.async producer, three or one consumer warpgroups, or a tile that stages
    its output over Q: the same source as chain "off" but for the kernel's name."""
    from qattn.formats.dense.recipes import wgmma_chains

    d = 64 if tile[2] == 12 else 128
    on = KernelSpec(recipe="f16", head_dim=d, arch="sm_90a", mma="wgmma", tile=Tile(*tile),
                    options={**options, "chain": "on"})
    off = on.with_(options={**options, "chain": "off"})
    assert not wgmma_chains(on.tile, d, dict(on.options))
    assert render(on).replace(on.name, off.name) == render(off)


def test_bf16_output_of_the_i8_f16_kernel():
    spec = KernelSpec(recipe="i8-f16", head_dim=64, arch="sm_90a", mma="wgmma")
    ptx = _compiled(spec).ptx
    assert "cvt.rn.bf16x2.f32" in entry_ptx(ptx, entry_name(spec) + "_bf16")
    assert "cvt.rn.bf16x2.f32" not in entry_ptx(ptx, entry_name(spec) + "_f16")


def test_inspect_shows_the_wgmma_kernel():
    from click.testing import CliRunner

    from qattn.cli import main

    result = CliRunner().invoke(main, ["inspect", "prefill", "-f", "f16", "-d", "128", "--arch", "sm_90a", "--mma",
                                       "wgmma"])
    assert result.exit_code == 0, result.output
    assert "m128n128w8s2" in result.output and "HGMMA" in result.output and "mma.sync" not in result.output


@pytest.mark.parametrize("fmt,head_dim,causal,tile", [("f16", 128, False, (128, 176, 8, 2)), ("bf16", 128, True, (128, 176, 8, 2)),
                                                     ("f16", 256, True, (128, 64, 8, 2)), ("bf16", 256, False, (128, 64, 8, 2))])
def test_tiles_that_stage_the_output_over_q(fmt, head_dim, causal, tile):
    """FlashAttention-3's fp16 tile at d128 (128 x 176) and d256's tile: the output rows' own region does not
    fit beside two K/V slots, so each warp stages its rows over its own Q rows (swizzled rows of 2D bytes);
    every tile that fits keeps its region. ptxas keeps the key loop in registers: the few values it spills
    are stored before the first warpgroup MMA and loaded after the last."""
    from qattn.formats.dense.recipes import wgmma_stages_over_q

    spec = KernelSpec(recipe=fmt, head_dim=head_dim, causal=causal, arch="sm_90a", mma="wgmma", tile=Tile(*tile))
    bm, bn = tile[:2]
    assert wgmma_stages_over_q(spec.tile, head_dim)
    assert spec.family.smem_bytes(spec.tile, head_dim) == bm * 2 * head_dim + 2 * 2 * bn * 2 * head_dim + 64
    assert not any(wgmma_stages_over_q(Tile(*t), d) for d, t in ((128, (128, 128, 8, 2)), (64, (192, 128, 12, 2)),
                                                                  (128, (128, 160, 8, 2)), (128, (192, 80, 12, 2))))
    binary = _compiled(spec)  # the kernel's static_assert holds its smem to the recipe's
    assert "C7514" not in binary.log
    ptx = entry_ptx(binary.ptx, _attention_entry(spec))
    assert f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{fmt}.{fmt}" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{head_dim}k16.f32.{fmt}.{fmt}" in ptx
    sass = disassemble(binary.data, "cuda").splitlines()
    mmas = [i for i, line in enumerate(sass) if "HGMMA" in line]
    assert mmas and entry_resources(binary.log, _attention_entry(spec))["spill_stores"] <= 128
    assert all(i < mmas[0] for i, line in enumerate(sass) if "STL" in line)
    assert all(i > mmas[-1] for i, line in enumerate(sass) if "LDL" in line)

"""`qattn tune` without a GPU: the tuned-tile table (round trip, its key, a damaged file), the lookup
in default spec selection, shape classes, the candidate grid, the sweep with a fake runner and
timer, and the command line. CPU only."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

import qattn.api
import qattn.tune.command
import qattn.tune.run
import qattn.tune.sweep
from qattn.cli import main
from qattn.engine import registry
from qattn.engine import spec as spec_module
from qattn.engine import tuned
from qattn.engine.family import Tolerance
from qattn.engine.shape_class import SEQUENCE_HEAD_EDGES, ShapeClass, length_bucket, sequence_heads_bucket
from qattn.engine.spec import KernelSpec, builtin_spec, call_spec, call_specs, default_spec
from qattn.engine.tile import Tile
from qattn.formats.dense.launch import stride_variants
from qattn.tune.build import prebuild
from qattn.tune.candidates import candidate_specs, tunable_formats, units
from qattn.tune.case import Shape, output_problem
from qattn.tune.run import plan, run, steps
from qattn.tune.sweep import Rejected, sweep
from qattn.version import __version__

H200 = tuned.Device("NVIDIA H200", "570.124.06")
MHA_4K = ShapeClass("1K-4K", "1K-4K", False, "128-511")  # entry()'s shape: B4 H32
LONG = ShapeClass(">16K", ">16K", False, "<64")
BUILTIN = KernelSpec(recipe="f16", head_dim=128, arch="sm_90a").tile  # the family's default, m128n64w4s2


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("QATTN_CACHE_DIR", str(path))
    monkeypatch.delenv("QATTN_TUNED", raising=False)
    return path


@pytest.fixture
def on_h200(monkeypatch):
    """Behave as on an H200 (sm_90a) with driver 570.124.06, wherever the tests run."""
    monkeypatch.setattr(tuned, "current_device", lambda: H200)
    monkeypatch.setattr(spec_module, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(qattn.tune.command, "device_arch", lambda: "sm_90a")


def entry(tile="m64n64w4s3", *, device=H200, fmt="f16", head_dim=128, causal=False, shape_class=MHA_4K,
          candidates=None, tuned_at="2026-12-03T10:00:00") -> tuned.TunedEntry:
    candidates = candidates or {tile: 0.70, BUILTIN.name: 0.80}
    return tuned.TunedEntry(device, "sm_90a", fmt, head_dim, causal, shape_class, tuned.TunedKernel.from_name(tile),
                            candidates,
                            shape={"batch": 4, "heads": 32, "kv_heads": 32, "queries": 4096, "keys": 4096},
                            rejected={"m256n128w16s4": "rel_l2 1.0e+00 over the format's 2e-03"},
                            default_tile=BUILTIN.name, tuned_at=tuned_at)


# ---- the table ----------------------------------------------------------------------------------

def test_round_trip(cache_dir):
    stored = [entry(), entry("m128n32w4s2", causal=True), entry(shape_class=LONG, device=tuned.Device("X", "1"))]
    path = tuned.save(stored)
    assert path == cache_dir / "tuned.json"
    assert tuned.load() == stored
    assert json.loads(path.read_text())["entries"][0]["tile"] == "m64n64w4s3"


def test_save_replaces_the_entry_with_the_same_key_and_keeps_the_others():
    tuned.save([entry("m64n64w4s3"), entry(device=tuned.Device("NVIDIA A100", "550.1"))])
    tuned.save([entry("m128n32w4s2")])
    tiles = {(e.device.gpu, e.kernel.name) for e in tuned.load()}
    assert tiles == {("NVIDIA H200", "m128n32w4s2"), ("NVIDIA A100", "m64n64w4s3")}


@pytest.mark.parametrize("device", [tuned.Device("NVIDIA H100 80GB HBM3", H200.driver),
                                    tuned.Device(H200.gpu, "575.51.03"),
                                    tuned.Device(H200.gpu, H200.driver, "0.0.1")])
def test_an_entry_of_another_gpu_driver_or_version_is_ignored(on_h200, device):
    tuned.save([entry(device=device)])
    assert tuned.lookup("f16", 128, False, "sm_90a") is None
    tuned.save([entry()])
    assert tuned.lookup("f16", 128, False, "sm_90a") == tuned.TunedKernel(Tile(64, 64, 4, 3))


def test_the_rest_of_the_key_must_match(on_h200):
    tuned.save([entry()])
    assert tuned.lookup("f16", 128, False, "sm_90a") == tuned.TunedKernel(Tile(64, 64, 4, 3))
    for fmt, d, causal, arch in (("bf16", 128, False, "sm_90a"), ("f16", 64, False, "sm_90a"),
                                 ("f16", 128, True, "sm_90a"), ("f16", 128, False, "sm_80")):
        assert tuned.lookup(fmt, d, causal, arch) is None


def test_without_a_gpu_nothing_is_looked_up(monkeypatch):
    tuned.save([entry()])
    monkeypatch.setattr(tuned, "current_device", lambda: None)
    assert tuned.lookup("f16", 128, False, "sm_90a") is None


def test_qattn_tuned_0_ignores_the_table(on_h200, monkeypatch):
    tuned.save([entry()])
    monkeypatch.setenv("QATTN_TUNED", "0")
    assert tuned.lookup("f16", 128, False, "sm_90a") is None


@pytest.mark.parametrize("text", ["{not json", "[]", '{"schema": 99, "entries": []}', '{"schema": 1}'])
def test_a_damaged_file_warns_and_reads_as_empty(on_h200, cache_dir, text):
    cache_dir.mkdir(parents=True)
    (cache_dir / "tuned.json").write_text(text)
    with pytest.warns(UserWarning, match="ignoring the tuned-tile table"):
        assert tuned.lookup("f16", 128, False, "sm_90a") is None
    tuned.save([entry()])  # the next tune replaces it
    assert tuned.lookup("f16", 128, False, "sm_90a") == tuned.TunedKernel(Tile(64, 64, 4, 3))


def test_a_damaged_entry_is_skipped_with_a_warning(on_h200, cache_dir):
    good = entry().as_json()
    bad = [dict(good, tile="m64x64"), dict(good, head_dim="128"), {k: v for k, v in good.items() if k != "gpu"},
           dict(good, candidates={"m64n64w4s3": -1.0}), dict(good, tile="m32n32w4s2"), dict(good, queries="2K")]
    cache_dir.mkdir(parents=True)
    (cache_dir / "tuned.json").write_text(json.dumps({"schema": 1, "entries": [*bad, good]}))
    with pytest.warns(UserWarning, match="ignoring entry") as caught:
        assert tuned.load() == [entry()]
    assert len(caught) == len(bad)


def test_an_entry_stored_without_sequence_heads_takes_them_from_its_shape(on_h200, cache_dir):
    old = {k: v for k, v in entry().as_json().items() if k != "sequence_heads"}
    cache_dir.mkdir(parents=True)
    (cache_dir / "tuned.json").write_text(json.dumps({"schema": 1, "entries": [old, dict(old, shape={"batch": 1})]}))
    with pytest.warns(UserWarning, match="ignoring entry 1 .*KeyError"):  # no heads in its shape: nothing to derive
        assert tuned.load() == [entry()]


def test_best_overall_is_the_least_geometric_mean_slowdown():
    short = entry("m64n64w4s3", candidates={"m64n64w4s3": 1.0, "m128n64w4s2": 1.30, "m128n32w4s2": 1.05})
    long = entry("m128n64w4s2", shape_class=LONG,
                 candidates={"m64n64w4s3": 1.20, "m128n64w4s2": 1.0, "m128n32w4s2": 1.05})
    # slowdowns: m64n64 1.0 x 1.2, m128n64 1.3 x 1.0, m128n32 1.05 x 1.05: the last wins neither class
    assert tuned.best_overall([short, long]) == tuned.TunedKernel(Tile(128, 32, 4, 2))
    assert tuned.best_overall([short]) == tuned.TunedKernel(Tile(64, 64, 4, 3))
    assert tuned.best_overall([]) is None


def test_best_overall_without_a_common_candidate_takes_the_latest_sweep():
    old = entry("m64n64w4s3", candidates={"m64n64w4s3": 1.0}, tuned_at="2026-12-01T00:00:00")
    new = entry("m128n32w4s2", shape_class=LONG, candidates={"m128n32w4s2": 1.0}, tuned_at="2026-12-02T00:00:00")
    assert tuned.best_overall([new, old]) == tuned.TunedKernel(Tile(128, 32, 4, 2))


def test_a_shape_class_looks_up_its_own_winner_only(on_h200):
    tuned.save([entry("m64n64w4s3"), entry("m128n32w4s2", shape_class=LONG)])
    assert tuned.lookup("f16", 128, False, "sm_90a", LONG) == tuned.TunedKernel(Tile(128, 32, 4, 2))
    assert tuned.lookup("f16", 128, False, "sm_90a", ShapeClass("<=1K", "<=1K", True, "128-511")) is None
    # the same lengths over fewer sequence-heads are another class: B1 calls do not run a winner timed at B4
    assert tuned.lookup("f16", 128, False, "sm_90a", ShapeClass("1K-4K", "1K-4K", False, "<64")) is None


# ---- shape classes --------------------------------------------------------------------------------

def test_length_buckets_are_inclusive_above():
    assert [length_bucket(n) for n in (1, 1024, 1025, 4096, 4097, 16384, 16385, 131072)] == \
        ["<=1K", "<=1K", "1K-4K", "1K-4K", "4K-16K", "4K-16K", ">16K", ">16K"]


def test_sequence_heads_buckets_start_at_their_edges():
    assert [sequence_heads_bucket(n) for n in (1, 63, 64, 127, 128, 511, 512, 65536)] == \
        ["<64", "<64", "64-127", "64-127", "128-511", "128-511", ">=512", ">=512"]


def test_shape_class_of_a_call():
    assert ShapeClass.of(4096, 4096, 32, 32, batch=4) == MHA_4K
    assert ShapeClass.of(128, 32768, 32, 8, batch=1) == ShapeClass("<=1K", ">16K", True, "<64")
    assert ShapeClass.of(128, 32768, 32, 8, batch=16).name == "Lq <=1K, Lk >16K, GQA, >=512 seq-heads"
    with pytest.raises(ValueError, match="^heads: 32 is not a multiple of kv_heads 5"):
        ShapeClass.of(1, 1, 32, 5, batch=1)
    with pytest.raises(ValueError, match="^queries: expected a positive integer"):
        ShapeClass.of(0, 1, 1, 1, batch=1)
    with pytest.raises(ValueError, match="^batch: expected a positive integer"):
        ShapeClass.of(1, 1, 1, 1, batch=0)
    with pytest.raises(ValueError, match="^shape_class.sequence_heads: expected one of <64, 64-127"):
        ShapeClass("<=1K", "<=1K", False, "64")


def test_the_call_shape_class_counts_batch_times_query_heads():
    q, k = np.empty((2, 32, 700, 128)), np.empty((2, 8, 700, 128))
    assert qattn.api._shape_class(q, k) == ShapeClass("<=1K", "<=1K", True, "64-127")
    assert qattn.api._shape_class(q[:1], k[:1]).sequence_heads == "<64"
    assert qattn.api._shape_class(np.empty((0, 32, 700, 128)), k) is None  # an empty batch: the launcher's checks


def test_no_shape_class_spans_a_change_of_the_builtin_routes():
    """Every sequence-head count at which a listed kernel starts is a bucket edge, so the calls of one class
    (one stored winner) are the calls the built-in routes send to one kernel, length buckets aside."""
    listed = [choice for family in registry.FAMILIES.values() for fmt, head_dim, arch in (family.launch_tiles or {})
              for choice in registry.launch_choices(fmt, head_dim, arch)]
    counts = {choice.least_heads for choice in listed} - {1}
    assert counts, "the routes list kernels by sequence-heads: this test checks their counts"
    assert counts <= set(SEQUENCE_HEAD_EDGES)


# ---- default spec selection -----------------------------------------------------------------------

def test_default_spec_runs_the_stored_winner(on_h200):
    assert default_spec("f16", 128).tile == BUILTIN
    tuned.save([entry("m64n64w4s3")])
    assert default_spec("f16", 128).tile == Tile(64, 64, 4, 3)
    assert default_spec("f16", 128, causal=True).tile == KernelSpec(recipe="f16", causal=True, arch="sm_90a").tile
    assert default_spec("f16", 128, arch="sm_80").tile == BUILTIN  # the table is this GPU's
    assert default_spec("f16", 128, shape=MHA_4K).tile == Tile(64, 64, 4, 3)
    assert default_spec("f16", 128, shape=LONG).tile == BUILTIN  # a class not tuned: the built-in tables


def test_default_spec_falls_back_to_the_builtin_tables(on_h200, monkeypatch):
    tuned.save([entry("m64n64w4s3")])
    monkeypatch.setenv("QATTN_TUNED", "off")
    assert default_spec("f16", 128).tile == BUILTIN
    monkeypatch.delenv("QATTN_TUNED")
    monkeypatch.setattr(tuned, "current_device", lambda: tuned.Device("NVIDIA L4", "570.124.06"))
    assert default_spec("f16", 128).tile == BUILTIN


def test_a_stored_tile_the_family_no_longer_takes_warns_and_the_default_stands(on_h200):
    tuned.save([entry("m32n32w4s2", fmt="i8-f8")])  # the wgmma kernel takes 64, 128 or 192 rows
    with pytest.warns(UserWarning, match="ignoring the tuned kernel m32n32w4s2"):
        spec = default_spec("i8-f8", 128)
    assert spec.tile == KernelSpec(recipe="i8-f8", head_dim=128, arch="sm_90a").tile


def test_call_spec_runs_the_stored_winner_unless_a_tile_or_unit_is_named(on_h200):
    tuned.save([entry("m64n64w4s3")])
    assert call_spec("f16", 128, False, 4096, "sm_90a").tile == Tile(64, 64, 4, 3)
    assert call_spec("f16", 128, False, 4096, "sm_90a", tile=BUILTIN).tile == BUILTIN


def test_call_spec_order_named_then_stored_then_listed_then_default(on_h200):
    """Without a stored tile, f16 calls of enough rows run a listed wgmma kernel on sm_90a (causal from
    768 rows, with persistent blocks; non-causal d128 from 512, with persistent blocks below 4096) and fewer rows the
    mma.sync default; a tile stored for the call's shape class (measured on this GPU) comes before the
    list, a named unit or tile before both."""
    wgmma = call_spec("f16", 128, False, 4096, "sm_90a")
    assert wgmma.family.values["mma_unit"] == "wgmma" and wgmma.tile == Tile(128, 128, 8, 2)
    assert dict(call_spec("f16", 128, False, 1024, "sm_90a").options)["persistent"] == "on"
    assert dict(call_spec("f16", 128, True, 1024, "sm_90a").options)["persistent"] == "on"
    assert dict(call_spec("f16", 128, False, 4096, "sm_90a").options)["persistent"] == "off"
    short = call_spec("f16", 128, True, 767, "sm_90a")
    assert short.family.values["mma_unit"] == "mma.sync" and short.tile == BUILTIN
    assert call_spec("f16", 128, False, 4096, "sm_80").family.values["mma_unit"] == "mma.sync"
    tuned.save([entry("m64n64w4s3", shape_class=LONG)])
    assert call_spec("f16", 128, False, 32768, "sm_90a", shape=LONG).tile == Tile(64, 64, 4, 3)
    assert call_spec("f16", 128, False, 4096, "sm_90a", shape=MHA_4K) == wgmma  # that class was not tuned
    named = call_spec("f16", 128, False, 32768, "sm_90a", mma="mma.sync", shape=LONG)
    assert named.tile == BUILTIN and named.family.values["mma_unit"] == "mma.sync"
    with pytest.raises(ValueError, match="format: unknown 'f17'"):
        call_spec("f17", 128, False, 4096, "sm_90a")


def test_call_specs_add_the_stored_winners_of_the_calls_bucket(on_h200, monkeypatch):
    """What `qattn compile --queries/--all` builds: the listed kernel of the count, and the winners `qattn tune`
    stored for such calls on this GPU (of the count's query bucket; every bucket's where no count is given)."""
    listed = builtin_spec("f16", 128, False, 4096, "sm_90a")
    with_variants = [listed, *stride_variants(listed)]
    assert call_specs("f16", 128, False, "sm_90a", 4096) == with_variants
    tuned.save([entry("m64n64w4s3"), entry("m128n128w8s2@wgmma+persistent", shape_class=LONG,
                                           candidates={"m128n128w8s2@wgmma+persistent": 0.5})])
    stored_4k = call_spec("f16", 128, False, 4096, "sm_90a", shape=MHA_4K)
    assert stored_4k.tile == Tile(64, 64, 4, 3)
    assert call_specs("f16", 128, False, "sm_90a", 4096) == [listed, stored_4k, *stride_variants(listed)]
    every = call_specs("f16", 128, False, "sm_90a")
    assert {stored_4k, call_spec("f16", 128, False, 32768, "sm_90a", shape=LONG), listed} <= set(every)
    assert call_specs("f16", 128, False, "sm_90a", 100)[0].family.values["mma_unit"] == "mma.sync"
    assert len(call_specs("f16", 128, False, "sm_90a", 100)) == 1  # "<=1K" was not tuned
    monkeypatch.setenv("QATTN_TUNED", "0")
    assert call_specs("f16", 128, False, "sm_90a", 4096) == with_variants


# ---- candidates ---------------------------------------------------------------------------------

def test_candidates_are_the_valid_grid_tiles_on_each_unit_default_first():
    specs = candidate_specs("f16", 128, False, "sm_90a")
    assert specs[0] == KernelSpec(recipe="f16", head_dim=128, arch="sm_90a") and specs[0].tile == BUILTIN
    assert len({tuned.TunedKernel.of(s) for s in specs}) == len(specs) > 10
    assert all(s.tile.warps >= 4 and s.tile.block_n >= 32 for s in specs)
    assert {s.recipe for s in specs} == {"f16"} and not any(s.causal for s in specs)
    # on sm_90a the mma.sync kernel's grid, then the wgmma kernel's (its 64-row warpgroups, 64 or 128 keys)
    wgmma = [s for s in specs if s.mma == "wgmma"]
    plain = candidate_specs("f16", 128, False, "sm_90a", options=False)
    # (m128n128w8s3 and m192n64w12s4 fit by staging their output over Q's rows)
    assert len([s for s in plain if s.mma == "wgmma"]) == 13 and len(plain) == 40 + 13
    assert {"m128n128w8s3", "m192n64w12s4"} <= {s.tile.name for s in plain if s.mma == "wgmma"}
    # with the options (the default): persistent blocks on and off on every wgmma tile, turns on and off
    # where a tile has two or more consumer warpgroups (d128's default takes them: "=off" is named), and chained
    # items where persistent blocks of two warpgroups keep the output rows' region (8 of them), each also with its
    # rows by TMA stores and with its Q rows by the consumers' loads (d128's default: by the producer's TMA), and with
    # the grid's last round split where its loop fits (Q by the producer's TMA: 8 more)
    names = {tuned.TunedKernel.of(s).name for s in wgmma}
    assert len(wgmma) == 74 and len(specs) == 40 + 74
    assert {"m128n128w8s2@wgmma", "m128n128w8s2@wgmma+persistent", "m128n128w8s2@wgmma+pingpong=off",
            "m128n128w8s2@wgmma+persistent+pingpong=off", "m64n64w4s2@wgmma+persistent",
            "m128n128w8s2@wgmma+chain+persistent", "m128n64w8s3@wgmma+chain+persistent+pingpong=off",
            "m128n128w8s2@wgmma+chain+out_tma+persistent", "m128n128w8s2@wgmma+chain+persistent+q_tma=off",
            "m128n128w8s2@wgmma+chain+persistent+tail=split"} <= names
    assert not any("tail" in n and ("out_tma" in n or "q_tma=off" in n) for n in names)
    # TMA stores and Q loads only where items chain, and not both
    assert not any(("out_tma" in n or "q_tma" in n) and "chain" not in n for n in names)
    assert not any("out_tma" in n and "q_tma" in n for n in names)
    assert "m64n64w4s2@wgmma+pingpong=off" not in names  # one consumer warpgroup: no turns to take
    assert not {"m64n64w4s2@wgmma+chain+persistent", "m128n128w8s3@wgmma+chain+persistent"} & names  # nothing to chain
    wgmma = [s for s in plain if s.mma == "wgmma"]
    assert all(s.tile.block_m == 16 * s.tile.warps and s.tile.block_n in (64, 128) for s in wgmma)
    assert tuned.TunedKernel.of(wgmma[0]).name == "m64n64w4s2@wgmma"
    assert units("f16", 128, "sm_90a") == ["mma.sync", "wgmma"] and units("i8-f8", 128, "sm_90a") == ["wgmma", "mma.sync"]
    assert units("f16", 128, "sm_80") == ["mma.sync"] and units("f16", 96, "sm_90a") == ["mma.sync"]
    assert units("f32", 128, "sm_90a") == []
    assert not any(s.mma for s in candidate_specs("f16", 128, False, "sm_80"))


def test_candidates_narrowed_by_each_axis():
    specs = candidate_specs("f16", 128, True, "sm_90a", block_shapes=[(64, 64), (128, 32)], warps=[4], stages=[2, 3],
                            options=False)
    assert [tuned.TunedKernel.of(s).name for s in specs] == ["m64n64w4s2", "m64n64w4s3", "m128n32w4s2",
                                                             "m128n32w4s3", "m64n64w4s2@wgmma", "m64n64w4s3@wgmma"]
    assert all(s.causal for s in specs)
    sync = candidate_specs("f16", 128, True, "sm_90a", block_shapes=[(64, 64)], warps=[4], stages=[2], mma=["mma.sync"])
    assert [(s.tile.name, s.mma) for s in sync] == [("m64n64w4s2", None)]
    only = candidate_specs("i8-f8", 128, False, "sm_90a", mma=["mma.sync"])
    assert {s.mma for s in only} == {"mma.sync"}


def test_candidates_errors_name_the_argument():
    with pytest.raises(ValueError, match="^format 'kv8-imma': tune covers"):
        candidate_specs("kv8-imma", 128, False, "sm_90a")
    with pytest.raises(ValueError, match="^tile: no tile of the grid fits i8-f8 d128 on sm_90a"):
        candidate_specs("i8-f8", 128, False, "sm_90a", block_shapes=[(32, 32)], mma=["wgmma"])
    with pytest.raises(ValueError, match="^mma: f16 d128 on sm_80 builds with mma.sync, got 'wgmma'"):
        candidate_specs("f16", 128, False, "sm_80", mma=["wgmma"])
    with pytest.raises(ValueError, match="^head_dim: "):
        candidate_specs("i8-f8", 96, False, "sm_90a")


def test_tunable_formats_are_those_attention_builds_through_default_spec():
    assert tunable_formats() == ["f16", "bf16", "f32", "i8-f16", "i8-i8", "i8-f8"]


# ---- the sweep ----------------------------------------------------------------------------------

SPECS = [KernelSpec(recipe="f16", head_dim=128, arch="sm_90a", tile=Tile.from_name(name))
         for name in ("m128n64w4s2", "m64n64w4s3", "m128n32w4s2", "m64n32w4s2")]


def fake_runner(ms: dict, wrong=()):
    """prepare(spec) of a sweep: a launch that returns its kernel's time (by TunedKernel name), or Rejected
    for a wrong output."""
    def prepare(spec):
        name = tuned.TunedKernel.of(spec).name
        if name in wrong:
            raise Rejected("rel_l2 4.1e-01 over the format's 2e-03")
        return lambda: ms[name]
    return prepare


def fake_timer(fn, rounds):
    return fn()


def test_the_fastest_candidate_wins():
    ms = {"m128n64w4s2": 0.9, "m64n64w4s3": 0.7, "m128n32w4s2": 0.8, "m64n32w4s2": 1.2}
    result = sweep(SPECS, fake_runner(ms), rounds=3, timer=fake_timer)
    assert result.winner == tuned.TunedKernel(Tile(64, 64, 4, 3))
    assert {t.name: v for t, v in result.times.items()} == ms and not result.rejected


def test_a_wrong_candidate_is_rejected_and_never_timed():
    ms = {"m128n64w4s2": 0.9, "m64n64w4s3": 0.1, "m128n32w4s2": 0.8, "m64n32w4s2": 1.2}
    timed = []
    result = sweep(SPECS, fake_runner(ms, wrong={"m64n64w4s3"}), rounds=2,
                   timer=lambda fn, n: timed.append(fn()) or fn())
    assert result.winner == tuned.TunedKernel(Tile(128, 32, 4, 2))
    assert result.rejected == {tuned.TunedKernel(Tile(64, 64, 4, 3)): "rel_l2 4.1e-01 over the format's 2e-03"}
    assert 0.1 not in timed and len(timed) == 2 * 3


def test_the_median_of_the_rounds_is_kept():
    rounds = iter([1.0, 5.0, 2.0, 9.0, 1.5, 0.1])  # the second round runs b before a: a 1.0 9.0 1.5, b 5.0 2.0 0.1
    result = sweep(SPECS[:2], fake_runner({}), rounds=3, timer=lambda fn, n: next(rounds))
    assert {t.name: v for t, v in result.times.items()} == {"m128n64w4s2": 1.5, "m64n64w4s3": 2.0}


def test_progress_reports_each_check_and_each_round():
    lines = []
    sweep(SPECS, fake_runner(dict.fromkeys((s.tile.name for s in SPECS), 1.0), wrong={"m64n32w4s2"}), rounds=2,
          timer=fake_timer, progress=lines.append)
    assert len(lines) == len(SPECS) + 2
    assert lines[3].startswith("m64n32w4s2 rejected: rel_l2") and lines[-1].startswith("round 2 of 2 timed")


def test_every_candidate_rejected_has_no_winner():
    result = sweep(SPECS[:2], fake_runner({}, wrong={s.tile.name for s in SPECS}), timer=fake_timer)
    assert result.winner is None and len(result.rejected) == 2


def test_output_problem():
    tol = Tolerance(max_rel=2e-2, rel_l2=2e-3)
    ref = np.random.default_rng(0).standard_normal((2, 64, 16))
    assert output_problem(ref.astype(np.float16), 0, ref, tol) is None
    assert output_problem(ref, 3, ref, tol) == "3 outputs not written or not finite"
    assert output_problem(ref + 0.1, 0, ref, tol).startswith("max_rel ")
    assert output_problem(ref * 1.01, 0, ref, tol).startswith("rel_l2 1.00e-02 over the format's 2e-03")


# ---- a whole run, with a fake GPU -----------------------------------------------------------------

def fake_case(ms: dict, wrong=()):
    return lambda fmt, head_dim, causal, shape, seed: fake_runner(ms, wrong)


def compiled(specs, jobs, done):
    """prebuild, as if every spec compiled."""
    for spec in specs:
        done(spec, None)
    return {}


# what f16 d128 calls of 512 to 4095 query rows run on sm_90a without a tuned table (recipes' launch_tiles)
BUILTIN_2048 = "m128n128w8s2@wgmma+chain+persistent"


def test_each_sweep_starts_with_the_kernel_its_shape_runs_untuned():
    """Whatever the grid holds: i8-f16 d128 calls from 8192 rows run 192-key tiles (from 32768 rows non-causal,
    with V in the quantizer's tiles), which the default grid's block_n never reaches."""
    def only(fmt, d, causal, rows, **grid):
        (job,) = plan([fmt], [d], [causal], [Shape(1, 32, 32, rows, rows)], "sm_90a", **grid)
        return job

    for rows, name in ((8192, "m128n192w8s2"), (32768, "m128n192w8s2+v_tiles"), (4096, "m128n128w8s2")):
        job = only("i8-f16", 128, False, rows, block_shapes=[(128, 64)], warps=[8], stages=[2])
        assert job.specs[0] == builtin_spec("i8-f16", 128, False, rows, "sm_90a")
        assert job.default_tile == tuned.TunedKernel.of(job.specs[0]).name == name
    names = [tuned.TunedKernel.of(s).name for s in only("i8-f16", 128, False, 8192).specs]
    assert names[0] == "m128n192w8s2" and len(names) == len(set(names)) and "m128n64w8s2" in names
    # a grid that holds it has it once, first
    job = only("i8-f16", 64, True, 8192, block_shapes=[(128, 128), (192, 128)], warps=[8, 12], stages=[2, 3])
    names = [tuned.TunedKernel.of(s).name for s in job.specs]
    assert names[0] == job.default_tile == "m192n128w12s3" and names.count("m192n128w12s3") == 1
    assert "m128n128w8s2" in names and "m192n128w12s2" in names


def small_jobs(shapes=(Shape(2, 8, 8, 2048, 2048),)):
    return plan(["f16"], [128], [False], list(shapes), "sm_90a", block_shapes=[(64, 64), (128, 64)], warps=[4],
                stages=[2, 3], mma=["mma.sync"])


def test_run_stores_each_winner_under_its_key(on_h200, monkeypatch):
    monkeypatch.setattr(qattn.tune.run, "prebuild", compiled)
    jobs = small_jobs([Shape(2, 8, 8, 2048, 2048), Shape(1, 8, 2, 512, 32768)])
    ms = {"m64n64w4s2": 0.9, "m64n64w4s3": 0.8, "m128n64w4s2": 0.85, "m128n64w4s3": 1.0, BUILTIN_2048: 0.95}
    lines = []
    entries = run(jobs, rounds=2, case=fake_case(ms, wrong={"m64n64w4s3"}), timer=fake_timer, progress=lines.append)
    # four grid tiles and the kernel both shapes' calls run untuned compiled once; each sweep checks five
    assert len(lines) == steps(jobs, 2) == 5 + 2 * (5 + 2)
    assert [e.shape_class for e in entries] == [ShapeClass("1K-4K", "1K-4K", False, "<64"),
                                                 ShapeClass("<=1K", ">16K", True, "<64")]
    assert tuned.load() == entries
    stored = entries[0]
    assert (stored.device, stored.arch, stored.format, stored.head_dim, stored.causal) == (H200, "sm_90a", "f16", 128,
                                                                                          False)
    assert stored.kernel == tuned.TunedKernel(Tile(128, 64, 4, 2)) and stored.ms == 0.85
    assert stored.default_tile == BUILTIN_2048 and stored.candidates[BUILTIN_2048] == 0.95
    assert set(stored.rejected) == {"m64n64w4s3"} and set(stored.candidates) == {"m64n64w4s2", "m128n64w4s2",
                                                                                  "m128n64w4s3", BUILTIN_2048}
    assert default_spec("f16", 128).tile == Tile(128, 64, 4, 2)


def test_run_rejects_what_did_not_compile(on_h200, monkeypatch):
    jobs = small_jobs()
    broken = jobs[0].specs[0]
    monkeypatch.setattr(qattn.tune.run, "prebuild", lambda specs, jobs, done: {broken: "compile: error: too big"})
    names = [tuned.TunedKernel.of(s).name for s in jobs[0].specs]
    entries = run(jobs, case=fake_case(dict.fromkeys(names, 1.0)), timer=fake_timer)
    assert entries[0].rejected == {BUILTIN_2048: "compile: error: too big"} and BUILTIN_2048 == names[0]


def test_run_with_every_candidate_rejected_names_the_sweep(on_h200, monkeypatch):
    monkeypatch.setattr(qattn.tune.run, "prebuild", compiled)
    jobs = small_jobs()
    with pytest.raises(ValueError, match=r"^tile: every candidate of f16 d128 non-causal 2x2048 H8/8 was rejected"):
        run(jobs, case=fake_case({}, wrong={tuned.TunedKernel.of(s).name for s in jobs[0].specs}), timer=fake_timer)
    assert tuned.load() == []


def test_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr(tuned, "current_device", lambda: None)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        run(small_jobs())


def test_prebuild_compiles_in_processes(cache_dir):
    specs = [KernelSpec(recipe="f16", head_dim=64, arch="sm_90a", tile=Tile(64, 64, 4, s)) for s in (2, 3)]
    done = []
    assert prebuild(specs, 2, lambda spec, error: done.append((spec, error))) == {}
    assert sorted(done, key=lambda d: d[0].tile.stages) == [(specs[0], None), (specs[1], None)]
    assert len(list(cache_dir.glob("*/prefill_f16_d64_m64n64w4s*"))) == 2  # in the cache this process reads


# ---- the command line ---------------------------------------------------------------------------

def cli(*args):
    return CliRunner().invoke(main, ["tune", *args])


def test_show_with_nothing_stored(cache_dir):
    result = cli("--show")
    assert result.exit_code == 0, result.output
    assert f"no tuned tiles stored in {cache_dir / 'tuned.json'}" in result.output


def test_show_prints_the_table_without_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(tuned, "current_device", lambda: None)
    tuned.save([entry(), entry("m128n32w4s2", causal=True, device=tuned.Device(H200.gpu, H200.driver, "0.0.1"))])
    result = cli("--show", "--json", str(tmp_path / "t.json"))
    assert result.exit_code == 0, result.output
    for text in ("NVIDIA H200", "570.124.06", "m64n64w4s3", "Lq 1K-4K, Lk 1K-4K, MHA", "1.14x", "- (no GPU)",
                 f"no: qattn is {__version__}"):
        assert text in result.output
    assert [e["tile"] for e in json.loads((tmp_path / "t.json").read_text())] == ["m64n64w4s3", "m128n32w4s2"]


def test_show_says_whether_calls_here_use_an_entry(on_h200):
    tuned.save([entry(), entry(fmt="bf16", device=tuned.Device(H200.gpu, "575.1"))])
    output = cli("--show").output
    assert "yes" in output and "no: driver is 570.124.06" in output
    filtered = cli("--show", "-f", "bf16").output
    assert "bf16" in filtered and " f16 " not in filtered
    assert "no tuned tiles stored" in cli("--show", "-d", "64").output


def test_show_names_the_tile_of_calls_that_name_no_shape_class(on_h200):
    tuned.save([entry("m64n64w4s3", candidates={"m64n64w4s3": 1.0, "m128n32w4s2": 1.05}),
                entry("m128n64w4s2", shape_class=LONG, candidates={"m64n64w4s3": 1.2, "m128n64w4s2": 1.0,
                                                                   "m128n32w4s2": 1.05})])
    output = cli("--show").output
    assert "f16 d128 non-causal: a call that names no shape class (qattn.attention) runs m128n32w4s2" in output
    assert default_spec("f16", 128).tile == Tile(128, 32, 4, 2)


def test_show_notes_qattn_tuned_off(monkeypatch):
    tuned.save([entry()])
    monkeypatch.setenv("QATTN_TUNED", "0")
    assert "QATTN_TUNED is off" in cli("--show").output


def test_show_takes_no_sweep_options():
    result = cli("--show", "--shape", "1x1024", "--rounds", "3")
    assert result.exit_code == 2 and "leave out --shape, --rounds" in result.output


def test_without_a_gpu_tune_is_a_click_error(monkeypatch):
    monkeypatch.setattr(qattn.tune.command, "device_arch", lambda: None)
    result = cli("-f", "f16")
    assert result.exit_code == 1 and "Error: tune: no CUDA GPU found" in result.output
    assert isinstance(result.exception, SystemExit)  # a click error, no traceback


def test_show_with_a_damaged_table_warns(cache_dir):
    cache_dir.mkdir(parents=True)
    (cache_dir / "tuned.json").write_text("{")
    with pytest.warns(UserWarning, match="ignoring the tuned-tile table"):
        result = cli("--show")
    assert result.exit_code == 0 and "no tuned tiles stored" in result.output


@pytest.mark.parametrize("args,option", [(["-f", "kv8-imma"], "'--format'"), (["-f", "nope"], "'--format'"),
                                         (["--shape", "4*4096"], "'--shape'"), (["--tile", "64"], "'--tile'"),
                                         (["--warps", "0"], "'--warps'"), (["--stages", "5"], "'--stages'"),
                                         (["--kv-heads", "5"], "'--heads'"), (["-d", "80"], "'--head-dim'"),
                                         (["-f", "i8-f8", "--tile", "32x32"], "'--tile'")])
def test_bad_options_are_usage_errors_naming_the_option(on_h200, args, option):
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output


def test_tune_on_a_fake_gpu_prints_and_stores_the_winners(on_h200, monkeypatch, tmp_path):
    ms = {"m64n64w4s2": 0.9, "m64n64w4s3": 0.8, "m128n64w4s2": 0.85, "m128n64w4s3": 1.0,
          "m64n64w4s2@wgmma": 0.7, "m64n64w4s3@wgmma": 0.75, "m64n64w4s2@wgmma+persistent": 0.72,
          "m64n64w4s3@wgmma+persistent": 0.65, BUILTIN_2048: 0.85}
    monkeypatch.setattr(qattn.tune.run, "prebuild", compiled)
    monkeypatch.setattr(qattn.tune.run, "GpuCase", fake_case(ms))
    monkeypatch.setattr(qattn.tune.sweep, "round_timer", fake_timer)
    args = ("-f", "f16", "-d", "128", "--no-causal", "--shape", "2x2048", "--tile", "64x64", "--tile", "128x64",
            "--warps", "4", "--stages", "2", "--stages", "3")
    result = cli(*args, "--mma", "mma.sync", "--json", str(tmp_path / "run.json"))
    assert result.exit_code == 0, result.output
    assert "m64n64w4s3" in result.output and "1.06x" in result.output  # 0.85 (the calls' kernel untuned) / 0.8
    assert f"stored in {tuned.table_path()}" in result.output
    assert [e.kernel.name for e in tuned.load()] == ["m64n64w4s3"]
    record = json.loads((tmp_path / "run.json").read_text())[0]
    assert record["tile"] == "m64n64w4s3" and math.isclose(record["ms"], 0.8) and record["shape"]["batch"] == 2
    # both units (the default on sm_90a), tiles at their default options: the wgmma kernel wins, and calls
    # of that class run it
    result = cli(*args, "--no-options")
    assert result.exit_code == 0, result.output
    assert "m64n64w4s2@wgmma" in result.output and "1.21x" in result.output  # 0.85 / 0.7
    (stored,) = tuned.load()
    assert stored.kernel == tuned.TunedKernel(Tile(64, 64, 4, 2), "wgmma") and len(stored.candidates) == 7
    timed = ShapeClass("1K-4K", "1K-4K", False, "64-127")  # 2x2048 at 32 heads
    chosen = default_spec("f16", 128, shape=timed)
    assert chosen.family.values["mma_unit"] == "wgmma" and chosen.tile == Tile(64, 64, 4, 2)
    assert call_spec("f16", 128, False, 2048, "sm_90a", shape=timed) == chosen
    assert call_spec("f16", 128, False, 2048, "sm_90a", shape=MHA_4K) != chosen  # B4: not the class timed
    # and each tile with its options (the default): persistent blocks win, stored by name, and run
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert "m64n64w4s3@wgmma+persistent" in result.output and "1.31x" in result.output  # 0.85 / 0.65
    (stored,) = tuned.load()
    assert stored.kernel == tuned.TunedKernel(Tile(64, 64, 4, 3), "wgmma", (("persistent", "on"),))
    assert len(stored.candidates) == 9
    chosen = call_spec("f16", 128, False, 2048, "sm_90a", shape=timed)
    assert dict(chosen.options)["persistent"] == "on" and chosen.tile == Tile(64, 64, 4, 3)
    assert tuned.TunedKernel.of(chosen) == stored.kernel


def test_tuned_kernel_names_carry_the_options_that_differ_from_the_default():
    """TunedKernel.of names a spec's options only where they differ from its family's default at its
    head dim (d128's wgmma default takes turns: "+pingpong=off" is named, "+pingpong" is not), and
    from_name reads every name back, the names stored before options existed among them."""
    base = KernelSpec(recipe="f16", head_dim=128, arch="sm_90a", mma="wgmma")
    assert tuned.TunedKernel.of(base).name == "m128n128w8s2@wgmma"
    both = base.with_(options={"pingpong": "off", "persistent": "on"})
    kernel = tuned.TunedKernel.of(both)
    assert kernel.name == "m128n128w8s2@wgmma+persistent+pingpong=off"
    assert tuned.TunedKernel.from_name(kernel.name) == kernel
    d64 = KernelSpec(recipe="f16", head_dim=64, arch="sm_90a", mma="wgmma", options={"pingpong": "on"})
    assert tuned.TunedKernel.of(d64).name == "m128n128w8s2@wgmma+pingpong"
    assert tuned.TunedKernel.from_name("m64n64w4s3") == tuned.TunedKernel(Tile(64, 64, 4, 3))

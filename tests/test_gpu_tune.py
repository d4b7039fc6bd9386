"""`qattn tune` on the GPU: a tiny sweep through the command line stores its winner, and
qattn.attention runs that kernel from then on, still within tolerance of FP64; correct candidates of
other formats and shapes (GQA, causal with Lq < Lk, bf16, int8 QK) pass the sweep's check."""
import numpy as np
import pytest
from click.testing import CliRunner

import qattn
import qattn.api
from qattn.check import metrics, reference
from qattn.cli import main
from qattn.engine import tuned
from qattn.engine.shape_class import ShapeClass
from qattn.engine.spec import builtin_spec, device_arch
from qattn.tune import run as tuning
from qattn.tune.case import Shape

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QATTN_TUNED", raising=False)


def test_tune_then_attention_runs_the_winner(monkeypatch):
    import cupy

    builtin = tuned.TunedKernel.of(builtin_spec("f16", 64, False, 512, device_arch(), heads=4)).name  # B1 x 4 heads
    # two tiles beside the kernel such calls run untuned (always a candidate): whichever wins, calls run it
    result = CliRunner().invoke(main, ["tune", "-f", "f16", "-d", "64", "--no-causal", "--shape", "1x512",
                                       "--heads", "4", "--tile", "64x64", "--warps", "4", "--stages", "2",
                                       "--stages", "3", "--jobs", "2"])
    assert result.exit_code == 0, result.output
    (entry,) = tuned.load()
    # on sm_90a the same tiles on the wgmma kernel too, with persistent blocks and without
    wgmma = {f"m64n64w4s{s}@wgmma{p}" for s in (2, 3) for p in ("", "+persistent")}
    names = {builtin, "m64n64w4s2", "m64n64w4s3"} | (wgmma if device_arch() == "sm_90a" else set())
    assert set(entry.candidates) == names and not entry.rejected, entry
    assert entry.default_tile == builtin and entry.device == tuned.current_device()
    assert entry.ms == min(entry.candidates.values())
    assert "yes" in CliRunner().invoke(main, ["tune", "--show"]).output

    assert tuned.TunedKernel.of(qattn.default_spec("f16", 64)) == entry.kernel
    monkeypatch.setattr(qattn.api, "_CALL_KERNELS", {})  # forget the kernels earlier calls in this process chose
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s).astype(np.float16) for s in ((2, 4, 300, 64), (2, 4, 700, 64), (2, 4, 700, 64))]
    out = qattn.attention(*(cupy.asarray(x) for x in host))
    assert [tuned.TunedKernel.of(kernel.spec) for kernel in qattn.api._CALL_KERNELS.values()] == [entry.kernel]
    err = metrics.compare(out, reference.attention(*host))
    assert err.nonfinite == 0 and err.rel_l2 <= 2e-3, err

    monkeypatch.setenv("QATTN_TUNED", "0")
    assert qattn.default_spec("f16", 64).tile == qattn.KernelSpec(recipe="f16", head_dim=64, arch=device_arch()).tile


@pytest.mark.parametrize("fmt", ["f16", "bf16", "i8-f16", "i8-f8"])
def test_correct_candidates_pass_the_check(fmt):
    arch = device_arch()
    jobs = tuning.plan([fmt], [128], [True], [Shape(2, 8, 2, 300, 1100)], arch, block_shapes=[(64, 64)], warps=[4],
                       stages=[2, 3])
    (entry,) = tuning.run(jobs, rounds=1, build_jobs=2)
    names = {tuned.TunedKernel.of(spec).name for spec in jobs[0].specs}  # each unit the arch has for fmt
    assert {"m64n64w4s2", "m64n64w4s3"} <= names
    assert not entry.rejected and set(entry.candidates) == names, entry
    assert entry.shape_class == ShapeClass("<=1K", "1K-4K", True, "<64")

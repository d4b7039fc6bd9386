"""`qattn plan prefill` on the GPU: every candidate's whole call timed at the operating point, and the
command choosing from those times."""
import pytest
from click.testing import CliRunner

from qattn.check import prefill_plan as plan
from qattn.cli import main

pytestmark = pytest.mark.gpu


def test_measured_times_cover_every_candidate():
    names = [c.name for c in plan.candidates("float16")]
    times = plan.measured_times(names, batch=1, seq=700, heads=4, head_dim=64, causal=True)
    assert set(times) == set(names) and all(0 < ms < 1000 for ms in times.values()), times
    bf16 = plan.measured_times(["bf16", "i8-f8 +balance"], batch=1, seq=700, heads=4, head_dim=64, causal=False)
    assert set(bf16) == {"bf16", "i8-f8 +balance"}


def test_plan_prefill_measures_on_this_gpu():
    result = CliRunner().invoke(main, ["plan", "prefill", "--batch", "1", "--seq", "1100", "--heads", "4",
                                       "--kv-heads", "2", "--head-dim", "64", "--measure"])
    assert result.exit_code == 0, result.output
    assert "time (ms)" in result.output and "measured on this GPU" in result.output
    assert sum(line.startswith("chosen: ") for line in result.output.splitlines()) == 1

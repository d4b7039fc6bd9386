"""The timing helpers that need no GPU to check: interleaved rounds (bench.timing.time_interleaved,
with a fake timer), the sustained timer's loop (time_sustained, with a fake cupy) and the
argument checks."""
import subprocess
import sys
import types
from pathlib import Path

import pytest

from qattn.bench.prefill import bench_prefill

from qattn.bench.timing import time_interleaved, time_sustained

ROOT = Path(__file__).resolve().parents[1]


def test_rounds_visit_every_function_in_turn():
    order = []

    def timer(fn, rounds):
        assert rounds == 3
        order.append(fn())
        return 10.0 * len(order)

    times = time_interleaved([lambda: "a", lambda: "b"], rounds=3, timer=timer)
    assert order == ["a", "b", "b", "a", "a", "b"]  # every fn once a round, not all of a's first
    assert times == [[10.0, 40.0, 50.0], [20.0, 30.0, 60.0]]  # per fn, in round order


def test_odd_rounds_run_in_reverse():
    # No fn always follows the same one (on a power-capped GPU the one after a hungry kernel
    # starts at a lower clock): each neighbouring pair runs in both orders.
    order = []
    fns = [lambda c=c: c for c in "abc"]
    time_interleaved(fns, rounds=2, timer=lambda fn, n: order.append(fn()) or 1.0)
    assert order == list("abc") + list("cba")
    followers = {(order[i - 1], order[i]) for i in range(1, len(order)) if i % 3}
    assert followers == {("a", "b"), ("b", "c"), ("c", "b"), ("b", "a")}


def test_settle_idles_before_every_timing():
    # The pause comes before each fn's timing, not once a round: no fn is timed straight after another.
    events = []
    time_interleaved([lambda c=c: c for c in "ab"], rounds=2, timer=lambda fn, n: events.append(fn()) or 1.0,
                     settle=0.25, sleep=lambda s: events.append(s))
    assert events == [0.25, "a", 0.25, "b", 0.25, "b", 0.25, "a"]
    events.clear()
    time_interleaved([lambda: "a"], rounds=2, timer=lambda fn, n: events.append(fn()) or 1.0,
                     sleep=lambda s: events.append(s))
    assert events == ["a", "a"]  # no settle: no pause


@pytest.mark.parametrize("settle", [-0.5, float("nan")])
def test_settle_must_not_be_negative(settle):
    with pytest.raises(ValueError, match="settle: expected a non-negative number of seconds"):
        time_interleaved([lambda: None], rounds=1, timer=lambda fn, n: 1.0, settle=settle)
    with pytest.raises(ValueError, match="settle: expected a non-negative number of seconds"):
        bench_prefill([(1, 1, 128)], settle=settle)


@pytest.mark.parametrize("rounds", [0, -2])
def test_rounds_must_be_positive(rounds):
    with pytest.raises(ValueError, match="rounds: expected a positive integer"):
        time_interleaved([lambda: None], rounds=rounds, timer=lambda fn, n: 1.0)


def test_time_queued_needs_calls():
    from qattn.bench.timing import time_queued

    with pytest.raises(ValueError, match="calls: expected a positive integer"):
        time_queued(lambda: None, calls=0)


class _FakeCupy:
    """Just enough of cupy for time_sustained: a stream, events that note when they were
    recorded (in calls made so far) and when they were waited for, and an elapsed time of 2 ms
    per call."""

    def __init__(self):
        self.calls = 0
        self.log = []  # ("record" | "wait", calls so far)
        fake = self

        class Event:
            def record(self):
                self.at = fake.calls
                fake.log.append(("record", fake.calls))

            def synchronize(self):
                fake.log.append(("wait", self.at))

        stream = types.SimpleNamespace(synchronize=lambda: fake.log.append(("wait", fake.calls)))
        self.cuda = types.SimpleNamespace(Event=Event, get_current_stream=lambda: stream,
                                          get_elapsed_time=lambda a, b: 2.0 * (b.at - a.at))

    def fn(self):
        self.calls += 1


def test_sustained_keeps_one_batch_queued_and_times_the_whole_stretch(monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    ms = time_sustained(fake.fn, seconds=0.02, batch=4)
    assert ms == pytest.approx(2.0)  # elapsed over the stretch / calls in it
    timed = fake.calls - 1  # one warm-up call
    assert timed >= 8 and timed % 4 == 0
    # Each wait inside the loop is for the batch before the one just queued: the GPU always has work.
    waits = [at for kind, at in fake.log if kind == "wait"][1:-1]
    records = [at for kind, at in fake.log if kind == "record"][1:-1]
    assert waits == records[:len(waits)] and len(waits) == len(records) - 1


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan")])
def test_sustained_needs_a_positive_duration(seconds):
    with pytest.raises(ValueError, match="seconds: expected a positive duration"):
        time_sustained(lambda: None, seconds)
    with pytest.raises(ValueError, match="sustained: expected a positive number of seconds"):
        bench_prefill([(1, 1, 128)], sustained=seconds)


@pytest.mark.parametrize("flag, value, expected", [("--sustained", "0", "positive"), ("--settle", "-1", "non-negative")])
def test_bench_prefill_tool_refuses_bad_durations(flag, value, expected):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_prefill.py"), flag, value],
                            capture_output=True, text=True)
    assert result.returncode == 2 and flag in result.stderr and expected in result.stderr


def test_bench_kv8_tool_refuses_zero_rounds():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_kv8.py"), "--rounds", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--rounds" in result.stderr and "positive" in result.stderr


def _fake_module(monkeypatch, name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.fixture
def fake_torch(monkeypatch):
    """Just enough of torch for _peer to import (the peers are only resolved, never run)."""
    torch = _fake_module(monkeypatch, "torch")
    torch.nn = _fake_module(monkeypatch, "torch.nn")
    torch.nn.attention = _fake_module(monkeypatch, "torch.nn.attention", SDPBackend=types.SimpleNamespace(),
                                      sdpa_kernel=None)


def _sage(monkeypatch, name, version):
    calls = []

    def sageattn(q, k, v, tensor_layout, is_causal):
        calls.append((name, tensor_layout, is_causal))
        return name

    extra = {"sageattn_qk_int8_pv_fp8_cuda": object()} if version == 2 else {}
    _fake_module(monkeypatch, name, sageattn=sageattn, **extra)
    return calls


def test_sageattention2_runs_beside_1_0_6_under_its_own_name(monkeypatch, fake_torch):
    from qattn.bench.peers import peer

    v1, v2 = _sage(monkeypatch, "sageattention", 1), _sage(monkeypatch, "sageattention2", 2)
    assert peer("sageattn")(1, 2, 3, True) == "sageattention"
    assert peer("sageattn2")(1, 2, 3, False) == "sageattention2"
    assert v1 == [("sageattention", "HND", True)] and v2 == [("sageattention2", "HND", False)]


def test_sageattention_of_version_2_is_one_peer_not_two(monkeypatch, fake_torch):
    from qattn.bench.peers import peer

    monkeypatch.setitem(sys.modules, "sageattention2", None)  # import fails
    _sage(monkeypatch, "sageattention", 2)
    assert peer("sageattn")(1, 2, 3, True) == "sageattention"
    assert peer("sageattn2") is None  # the same package: timed once, as sageattn


def test_only_sageattention_1_0_6_has_no_sageattn2(monkeypatch, fake_torch):
    from qattn.bench.peers import PEERS, peer

    monkeypatch.setitem(sys.modules, "sageattention2", None)
    _sage(monkeypatch, "sageattention", 1)
    assert "sageattn2" in PEERS
    assert peer("sageattn") is not None and peer("sageattn2") is None


def test_accuracy_names_a_bad_source_or_query_count():
    from qattn.bench.prefill import accuracy_against_fp64

    with pytest.raises(ValueError, match="sources: unknown source 'gauss'"):
        accuracy_against_fp64(("gauss",))
    with pytest.raises(ValueError, match="max_queries: expected a positive number"):
        accuracy_against_fp64(("normal",), max_queries=0)


@pytest.mark.parametrize("args,message", [(["--preset", "gauss"], "invalid choice: 'gauss'"),
                                          (["--ctx", "0"], "expected a positive integer, got 0")])
def test_accuracy_tool_refuses_bad_arguments(args, message):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_accuracy.py"), *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr


def test_with_ratios_takes_medians_and_compares_with_every_peer():
    from qattn.bench.timing import with_ratios

    timed = [({"impl": "sdpa_cudnn"}, None), ({"impl": "sdpa_flash"}, None), ({"impl": "qattn:f16"}, None)]
    records = with_ratios(timed, [[2.0, 2.4, 2.2], [3.0, 3.3, 3.6], [1.0, 1.2, 1.1]], ("sdpa_cudnn", "sdpa_flash"))
    assert [r["ms"] for r in records] == [2.2, 3.3, 1.1] and records[2]["round_ms"] == [1.0, 1.2, 1.1]
    assert records[2]["vs_sdpa_cudnn"] == pytest.approx(2.0) and records[2]["vs_sdpa_flash"] == pytest.approx(3.0)
    assert not any(k.startswith("vs_") for r in records[:2] for k in r)  # peers are not compared with peers


def test_kernel_entries_name_a_unit_options_and_a_tile():
    """The benchmark entries FORMAT[@UNIT][+OPTION[=VALUE]...][:TILE] of bench_prefill and
    tools/time_kernels.py: each part optional, options "on" unless given a value, a bad part refused
    by name."""
    from qattn.bench.prefill import kernel_entry
    from qattn.engine.tile import Tile

    assert kernel_entry("i8-f8") == ("i8-f8", None, {}, None)
    assert kernel_entry("i8-f8@mma.sync") == ("i8-f8", "mma.sync", {}, None)
    assert kernel_entry("f16@wgmma+persistent+pingpong=off:m128n160w8s2") == (
        "f16", "wgmma", {"persistent": "on", "pingpong": "off"}, Tile(128, 160, 8, 2))
    assert kernel_entry("i8-f16+pingpong") == ("i8-f16", None, {"pingpong": "on"}, None)
    for bad, why in (("f16@wgmma+", "OPTION"), ("f16+pingpong=", "OPTION"), ("f16:m128", "tile name")):
        with pytest.raises(ValueError, match=why):
            kernel_entry(bad)


def test_time_kernels_tool_refuses_a_bad_shape():
    tool = Path(__file__).resolve().parent.parent / "tools" / "time_kernels.py"
    res = subprocess.run([sys.executable, str(tool), "f16", "--shape", "4x32x4096"], capture_output=True, text=True)
    assert res.returncode == 2 and "BATCHxHEADSxSEQxHEAD_DIM" in res.stderr


def test_time_kernels_tool_names_what_peers_need():
    pytest.importorskip("cupy")
    try:
        import torch  # noqa: F401
    except ImportError:
        tool = Path(__file__).resolve().parent.parent / "tools" / "time_kernels.py"
        res = subprocess.run([sys.executable, str(tool), "f16", "--peers"], capture_output=True, text=True)
        assert res.returncode == 2 and "--peers" in res.stderr and "torch" in res.stderr
    else:
        pytest.skip("torch is installed: --peers runs")

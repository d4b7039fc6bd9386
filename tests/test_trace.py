"""The wgmma prefill kernels' trace points (qattn.bench.trace): the instrumented builds compile, the recorded
events decode, and the analysis reads idle stretches, late bursts and item phases as defined. On the GPU: one
traced call records every consumer warpgroup's bursts, one per key tile and item."""

import numpy as np
import pytest

from qattn.bench import trace
from qattn.engine.compile import compile_cuda
from qattn.engine.render import main_entry_name, render
from qattn.engine.spec import KernelSpec
from qattn.engine.tile import Tile


def _event(role, n, clock, point, arg=0, sm=3, block=0):
    return {"block": block, "role": role, "n": n, "clock": clock, "point": point, "arg": arg, "sm": sm}


def _role(role, timeline, sm=3, block=0):
    return [_event(role, n, clock, point, arg, sm, block) for n, (clock, point, arg) in enumerate(timeline)]


def test_idle_stretches_are_the_issue_queue_running_dry():
    cycles = {"s": 100, "pv": 100}
    events = (_role(0, [(0, "ROLE_START", 0), (10, "S_ISSUED", 0), (120, "S_LANDED", 0), (200, "SOFTMAX_DONE", 0),
                        (300, "S_PV_ISSUED", 0), (510, "S_LANDED", 1), (520, "PV_LANDED", 0)])
              + _role(1, [(0, "ROLE_START", 0), (50, "S_ISSUED", 0), (150, "S_LANDED", 0), (260, "SOFTMAX_DONE", 0)])
              + _role(2, [(0, "ROLE_START", 0), (5, "K_FREE", 0), (6, "V_FREE", 0)]))
    result = trace.analyse(events, cycles)
    # queue: wg0's S 10-110, wg1's S 110-210, dry 210-300, wg0's S and PV 300-500
    assert result["busy_cycles"] == 400 and result["idle_cycles"] == 90 and result["span_cycles"] == 520
    ((state, idle),) = result["idle_by_state"]
    assert idle == 90 and state == "wg0:SOFTMAX_DONE wg1:S_LANDED producer:V_FREE"
    assert result["late_bursts"] == 1  # wg1 saw its S land at 150, before the queue could finish it at 210


def test_a_burst_of_both_products_is_late_only_if_its_first_lands_early():
    """S issued with PV lands once S is done, before the PV: that is on time; landing before S could be done is not."""
    cycles = {"s": 100, "pv": 100}
    on_time = _role(0, [(0, "ROLE_START", 0), (10, "S_PV_ISSUED", 0), (115, "S_LANDED", 1), (215, "PV_LANDED", 0)])
    early = _role(0, [(0, "ROLE_START", 0), (10, "S_PV_ISSUED", 0), (60, "S_LANDED", 1), (215, "PV_LANDED", 0)])
    assert trace.analyse(on_time, cycles)["late_bursts"] == 0
    assert trace.analyse(early, cycles)["late_bursts"] == 1


def test_sms_are_queued_apart_and_back_to_back_issues_leave_no_gap():
    cycles = {"s": 50, "pv": 70}
    events = (_role(0, [(0, "ROLE_START", 0), (10, "PV_ISSUED", 0), (20, "S_ISSUED", 1), (200, "PV_LANDED", 0)], sm=0)
              + _role(0, [(1000, "ROLE_START", 0), (1000, "S_ISSUED", 0), (1200, "S_ISSUED", 1),
                          (1300, "S_LANDED", 1)], sm=1, block=1))
    result = trace.analyse(events, cycles)
    assert result["busy_cycles"] == 70 + 50 + 50 + 50 and result["idle_cycles"] == 150  # sm 1: 1050-1200
    assert result["span_cycles"] == 200 + 300 and result["late_bursts"] == 0


def test_blocks_sharing_an_sm_are_told_apart_and_finished_ones_left_out():
    cycles = {"s": 100, "pv": 100}
    events = (_role(0, [(0, "ROLE_START", 0), (10, "S_ISSUED", 0), (50, "ITEM_END", 0)], block=4)
              + _role(0, [(60, "ROLE_START", 0), (70, "S_ISSUED", 0), (200, "SOFTMAX_DONE", 0),
                          (400, "S_ISSUED", 1), (410, "ITEM_END", 1)], block=9)
              + _role(0, [(65, "ROLE_START", 0), (260, "Q_LANDED", 0), (500, "S_ISSUED", 0)], block=11))
    result = trace.analyse(events, cycles)
    # queue: 10-110, 110-210, dry 210-400 (block 4 done: blocks 9 and 11 on the SM), 400-500, 500-600
    assert result["idle_by_state"] == [("b0.wg0:SOFTMAX_DONE b1.wg0:ROLE_START", 190)]


def test_item_phases_follow_one_another():
    timeline = [(0, "ROLE_START", 0)]
    for item, base in enumerate((100, 1100)):
        timeline += [(base, "ITEM_START", item), (base + 40, "Q_LANDED", item), (base + 50, "S_ISSUED", 0),
                     (base + 80, "S_LANDED", 0), (base + 130, "SOFTMAX_DONE", 0), (base + 160, "S_PV_ISSUED", 0),
                     (base + 200, "S_LANDED", 1), (base + 260, "SOFTMAX_DONE", 1), (base + 700, "KEYS_DONE", item),
                     (base + 900, "ITEM_END", item)]
    phases = trace.analyse(_role(0, timeline) + _role(1, [(0, "ROLE_START", 0)]), {"s": 1, "pv": 1})["phases"]
    assert phases == {"Q load": 40, "turn, first S issued": 10, "first S": 30, "first softmax": 50, "key loop": 570,
                      "output": 200, "whole item": 900, "to the next item": 100}


def test_item_phases_when_the_next_item_starts_before_the_output():
    """A schedule whose next item's Q lands and first S is issued before this item's output is written: the next
    ITEM_START comes before this one's ITEM_END, and each item's phases still end at its own points."""
    timeline = [(0, "ROLE_START", 0), (100, "ITEM_START", 0), (140, "Q_LANDED", 0), (150, "S_ISSUED", 0)]
    for item, base in enumerate((100, 1100)):
        timeline += [(base + 80, "S_LANDED", 0), (base + 130, "SOFTMAX_DONE", 0), (base + 700, "KEYS_DONE", item)]
        if item == 0:
            timeline += [(base + 710, "ITEM_START", 1), (base + 720, "Q_LANDED", 1), (base + 760, "S_ISSUED", 0)]
        timeline += [(base + 900, "ITEM_END", item)]
    phases = trace.analyse(_role(0, timeline) + _role(1, [(0, "ROLE_START", 0)]), {"s": 1, "pv": 1})["phases"]
    # item 1: Q load 10, turn 40, first S 1180 - 860 = 320, softmax 50, keys 570, output 200
    assert phases["output"] == 200 and phases["key loop"] == 570 and phases["first softmax"] == 50
    assert phases["Q load"] == (40 + 10) / 2 and phases["whole item"] == (900 + 1190) / 2
    assert "to the next item" not in phases


def test_block_ends_read_the_grid_tail_on_the_shared_clock():
    """Block 0 ends two items at 900 (from the first event, at 100), block 1 one item at 600, block 2 two at 1000; the
    producer's later events and the second consumer's item count are not the block's."""
    events = (_role(0, [(100, "ROLE_START", 0), (400, "ITEM_END", 0), (1000, "ITEM_END", 1)], block=0)
              + _role(1, [(100, "ROLE_START", 0), (390, "ITEM_END", 0), (980, "ITEM_END", 1)], block=0)
              + _role(2, [(100, "ROLE_START", 0), (1500, "K_FREE", 0), (1600, "V_FREE", 0)], block=0)
              + _role(0, [(150, "ROLE_START", 0), (700, "ITEM_END", 2)], block=1)
              + _role(1, [(150, "ROLE_START", 0), (690, "ITEM_END", 2)], block=1)
              + _role(0, [(120, "ROLE_START", 0), (500, "ITEM_END", 3), (1100, "ITEM_END", 4)], block=2))
    ends = trace.block_ends(events)
    assert ends["span"] == 1000
    assert ends["idle_share"] == pytest.approx(1 - (900 + 600 + 1000) / 3 / 1000)
    assert ends["by_items"] == {1: {"blocks": 1, "min": 600, "median": 600, "max": 600},
                                2: {"blocks": 2, "min": 900, "median": 950, "max": 1000}}
    with pytest.raises(ValueError, match="no block finished"):
        trace.block_ends(_role(0, [(0, "ROLE_START", 0)]))


def test_an_unknown_trace_clock_is_refused():
    with pytest.raises(ValueError, match="clock: expected one of sm, global"):
        trace.prelude(4, 64, clock="wall")


def test_recorded_words_decode():
    blocks, events = 2, 3
    raw = np.zeros((blocks, trace.ROLES_MAX, events, 2), np.uint64)
    raw[1, 2, 0] = (777, trace.CODE["S_PV_ISSUED"] | (5 << 8) | (9 << 32))
    raw[1, 2, 1] = (900, trace.CODE["KV_READY"] | ((-1 & 0xffffff) << 8) | (9 << 32))
    got = trace.decode(raw.reshape(-1), blocks, events)
    assert got == [_event(2, 0, 777, "S_PV_ISSUED", 5, 9, 1), _event(2, 1, 900, "KV_READY", -1, 9, 1)]


@pytest.mark.parametrize("fmt, d, causal, tile, options", [
    ("f16", 128, False, None, {"persistent": "on"}), ("bf16", 64, True, Tile(192, 128, 12, 2), {}),
    ("bf16", 128, True, None, {"persistent": "on", "chain": "on"}),
    ("f16", 128, False, None, {"kv_rows": "on"}), ("i8-f16", 128, True, None, {}), ("i8-f8", 128, False, None, {})])
def test_instrumented_kernels_compile_with_every_point_recording(fmt, d, causal, tile, options):
    spec = KernelSpec(kind="prefill", recipe=fmt, head_dim=d, arch="sm_90a", mma="wgmma", causal=causal, tile=tile)
    if options:
        spec = spec.with_(options={**dict(spec.options), **options})
    plain = render(spec)
    points = {name for name in trace.POINTS if f"TRACE_{name}" in plain}
    assert {"ROLE_START", "ITEM_START", "Q_LANDED", "S_ISSUED", "S_LANDED", "PV_LANDED", "KEYS_DONE",
            "ITEM_END", "K_FREE", "V_FREE"} <= points
    binary = compile_cuda(trace.instrumented(plain, 4, 64), "sm_90a", spec.name + "_traced",
                          entry=main_entry_name(spec))
    assert "qattn_trace_events" in binary.ptx and "%clock64" in binary.ptx and "%smid" in binary.ptx
    on_global = compile_cuda(trace.instrumented(plain, 4, 64, clock="global"), "sm_90a", spec.name + "_traced_ns",
                             entry=main_entry_name(spec))
    assert "%globaltimer" in on_global.ptx and "%clock64" not in on_global.ptx


def test_kernels_without_trace_points_are_refused():
    spec = KernelSpec(kind="prefill", recipe="f16", head_dim=128, arch="sm_90a", mma="mma.sync")
    with pytest.raises(ValueError, match="no trace points"):
        trace.instrumented(render(spec), 4, 64)


@pytest.mark.gpu
def test_a_traced_call_records_each_key_tile_once():
    import cupy

    from qattn.engine.spec import call_spec, device_arch

    if device_arch() != "sm_90a":
        pytest.skip("the wgmma prefill kernels run on sm_90a")
    b, h, seq = 2, 4, 1000  # 64 items of 128 rows (one a block), 8 key tiles each, the last one partial
    spec = call_spec("f16", 128, False, seq, "sm_90a")
    xs = tuple(cupy.random.standard_normal((b, h, seq, 128), dtype=cupy.float32).astype(cupy.float16)
               for _ in range(3))
    events = trace.run_traced(spec, xs, blocks=8, events=512)
    roles = {(e["block"], e["role"]) for e in events}
    consumers = spec.tile.warps // 4
    assert {r for _, r in roles} == set(range(consumers + 1))
    items = sum(e["point"] == "ITEM_END" for e in events)
    assert items == 8 * consumers
    issued = [e for e in events if e["point"] in ("S_ISSUED", "S_PV_ISSUED", "PV_ISSUED")]
    s_bursts = sum(e["point"] in ("S_ISSUED", "S_PV_ISSUED") for e in issued)
    pv_bursts = sum(e["point"] in ("PV_ISSUED", "S_PV_ISSUED") for e in issued)
    assert s_bursts == pv_bursts == 8 * 8 * consumers
    result = trace.analyse(events, trace.burst_cycles(128, spec.tile.block_n, 16, 16))
    assert 0 < result["busy_share"] < 1 and result["phases"]["whole item"] > 0
    # the same call on the GPU's nanosecond timer: each traced block ended its one item, within the call's time
    ends = trace.block_ends(trace.run_traced(spec, xs, blocks=8, events=512, clock="global"))
    assert list(ends["by_items"]) == [1] and ends["by_items"][1]["blocks"] == 8
    assert 0 < ends["span"] < 1e8 and 0 <= ends["idle_share"] < 1

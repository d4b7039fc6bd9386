"""Where a warp-specialized wgmma prefill kernel's time goes, from its own clock: the kernel is built with its
trace points (QATTN_TRACE in templates/cuda/wgmma_attention.cuh.j2 and the kernels that include it) defined to
record, for thread 0 of each role of the first `blocks` blocks (a role is a consumer warpgroup, or the
producer's copying thread), the SM's cycle counter, the point, its argument (a key tile or a work item) and
the SM at each point passed. Off, the points compile to nothing.

The analysis reads a role's MMA issues (S, PV, or both) as work for one tensor pipe per SM, each taking the
cycles its FLOPs take at the pipe's peak rate (FLOPS_PER_CYCLE), served in issue order: the stretches where that
queue runs dry are the tensor pipe's idle time as the issues allow it, each put down to what every role on the
SM was doing when the stretch began (the last point it had passed). Beside it, per consumer role, the median
cycles of a work item's phases. A queue that finishes a burst's first product after its warpgroup saw that product
land means the model's rate is too high (`late_bursts`).

With clock="global" the points record the GPU's nanosecond timer (%globaltimer) instead, one clock for every SM:
`block_ends` then reads when each block finished its last item, i.e. how ragged a persistent grid's tail is (the
SM cycle counters of different SMs are not comparable, and the tensor pipe model needs cycles).
"""
from __future__ import annotations

import bisect
import contextlib
import statistics
import tempfile
from collections import defaultdict

import numpy as np

# The trace points, in the order of the enum the instrumented source defines.
POINTS = ("ROLE_START", "ITEM_START", "Q_LANDED", "KV_READY", "TURN", "S_ISSUED", "PV_ISSUED", "S_PV_ISSUED",
          "S_LANDED", "PV_LANDED", "SOFTMAX_DONE", "KEYS_DONE", "ITEM_END", "K_FREE", "V_FREE")
CODE = {name: i for i, name in enumerate(POINTS)}
ISSUES = {"S_ISSUED": ("s",), "PV_ISSUED": ("pv",), "S_PV_ISSUED": ("s", "pv")}
# Dense peak of one Hopper SM's tensor pipe, FLOPs a cycle: 16-bit operands, and 8-bit (twice).
FLOPS_PER_CYCLE = {16: 4096, 8: 8192}
ROLES_MAX = 4  # three consumer warpgroups and the producer's at most


# What a trace point records as its clock: the SM's cycle counter, or the GPU's nanosecond timer.
CLOCKS = {"sm": "e[0] = clock64();",
          "global": 'unsigned long long ns; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns)); e[0] = ns;'}


def prelude(blocks: int, events: int, clock: str = "sm") -> str:
    """CUDA text defining QATTN_TRACE to record into qattn_trace_events [blocks][ROLES_MAX][events][2], each event's
    clock from CLOCKS[clock]."""
    if clock not in CLOCKS:
        raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {clock!r}")
    enum = ", ".join(f"TRACE_{name} = {i}" for i, name in enumerate(POINTS))
    return f"""enum {{ {enum} }};
__device__ unsigned long long qattn_trace_events[{blocks} * {ROLES_MAX} * {events} * 2];
// each role's count of events, in global memory: static shared memory would move the kernel's 1024-aligned
// dynamic shared memory past the most a block may have
__device__ unsigned qattn_trace_n[{blocks} * {ROLES_MAX}];
static __device__ __forceinline__ void qattn_trace_event(int point, int arg) {{
    if (threadIdx.x % 128 != 0) return;
    const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), role = threadIdx.x / 128;
    if (block >= {blocks} || role >= {ROLES_MAX}) return;
    unsigned& count = qattn_trace_n[block * {ROLES_MAX} + role];
    if (point == TRACE_ROLE_START) count = 0;
    const unsigned n = count;
    if (n >= {events}) return;
    count = n + 1;
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    unsigned long long* e = qattn_trace_events + ((block * {ROLES_MAX} + role) * {events} + n) * 2;
    {CLOCKS[clock]}
    e[1] = static_cast<unsigned long long>(point) | static_cast<unsigned long long>(arg & 0xffffff) << 8 |
           static_cast<unsigned long long>(smid) << 32;
}}
#define QATTN_TRACE(point, arg) qattn_trace_event(point, arg)
"""


def instrumented(source: str, blocks: int, events: int, clock: str = "sm") -> str:
    """A rendered source with its trace points recording (prelude first)."""
    if "QATTN_TRACE(" not in source:
        raise ValueError("this kernel has no trace points (the warp-specialized wgmma prefill kernels have them)")
    return prelude(blocks, events, clock) + source


@contextlib.contextmanager
def traced_build(spec, blocks: int, events: int, clock: str = "sm"):
    """Kernels of `spec` built with their trace points recording (into a cache of their own) while inside."""
    from ..engine import kernel as kernel_module
    from ..engine.cache import KernelCache

    plain = kernel_module.render
    kernel_module._MEMORY.pop(spec, None)
    kernel_module.render = lambda s: instrumented(plain(s), blocks, events, clock) if s == spec else plain(s)
    try:
        with tempfile.TemporaryDirectory() as root:
            yield kernel_module.build_kernel(spec, KernelCache(root))
    finally:
        kernel_module.render = plain
        kernel_module._MEMORY.pop(spec, None)


def decode(raw: np.ndarray, blocks: int, events: int) -> list[dict]:
    """Recorded events ([blocks][ROLES_MAX][events][2] uint64) as dicts: block, role, n, clock, point, arg, sm;
    slots never written (clock 0) left out."""
    raw = raw.reshape(blocks, ROLES_MAX, events, 2)
    out = []
    for b, r, n in zip(*np.nonzero(raw[..., 0])):
        clock, meta = int(raw[b, r, n, 0]), int(raw[b, r, n, 1])
        arg = (meta >> 8) & 0xffffff
        out.append({"block": int(b), "role": int(r), "n": int(n), "clock": clock, "point": POINTS[meta & 0xff],
                    "arg": arg - (1 << 24) if arg >= 1 << 23 else arg, "sm": meta >> 32})
    return out


def burst_cycles(head_dim: int, block_n: int, s_bits: int, pv_bits: int) -> dict:
    """Tensor-pipe cycles of one warpgroup's S (64 rows x block_n keys x head_dim) and PV (64 x head_dim x block_n)."""
    flops = 2 * 64 * block_n * head_dim
    return {"s": flops / FLOPS_PER_CYCLE[s_bits], "pv": flops / FLOPS_PER_CYCLE[pv_bits]}


def producer_role(events: list[dict]):
    """The role index of the producer (the one whose events free K and V slots), or None."""
    return next((e["role"] for e in events if e["point"] in ("K_FREE", "V_FREE")), None)


def analyse(events: list[dict], cycles: dict) -> dict:
    """The tensor pipe's idle stretches per SM (the issue-order queue of the bursts, `cycles` per kind), each
    put down to the last point that every role of the blocks then on the SM had passed when it began (blocks
    sharing an SM are told apart as b0, b1, ... by their index), and the consumer roles' median phase cycles
    per work item. span: first to last event of each SM, summed; busy: the bursts' cycles; idle: the stretches
    between bursts; the rest is each SM's start and end (before its first burst, after its last)."""
    by_sm = defaultdict(list)
    for e in events:
        by_sm[e["sm"]].append(e)
    producer = producer_role(events)
    idle_by_state, late, busy_total, span_total = defaultdict(float), 0, 0.0, 0.0

    def role_name(role):
        return "producer" if role == producer else f"wg{role}"

    for sm_events in by_sm.values():
        sm_events.sort(key=lambda e: (e["clock"], e["block"], e["role"], e["n"]))
        span_total += sm_events[-1]["clock"] - sm_events[0]["clock"]
        lands = defaultdict(list)  # (block, role) -> clocks at which its bursts were seen landed
        lifetime = {}  # block -> (first, last) clock of its events
        for e in sm_events:
            if e["point"] in ("S_LANDED", "PV_LANDED"):
                lands[(e["block"], e["role"])].append(e["clock"])
            first, _ = lifetime.get(e["block"], (e["clock"], e["clock"]))
            lifetime[e["block"]] = (first, e["clock"])

        def label(at, last):
            blocks = sorted(b for b, (first, end) in lifetime.items() if first <= at <= end)
            name = {b: "" if len(blocks) == 1 else f"b{i}." for i, b in enumerate(blocks)}
            return " ".join(f"{name[b]}{role_name(r)}:{p}" for (b, r), p in sorted(last.items()) if b in name)

        free_at, gap_state, last = None, None, {}
        for e in sm_events:
            if free_at is not None and e["clock"] > free_at and gap_state is None:
                gap_state = label(free_at, last)  # the queue ran dry at free_at: what each role was doing then
            kinds = ISSUES.get(e["point"])
            if kinds is not None:
                work, first = sum(cycles[k] for k in kinds), cycles[kinds[0]]
                if free_at is not None and free_at < e["clock"]:
                    idle_by_state[gap_state] += e["clock"] - free_at
                start = e["clock"] if free_at is None else max(free_at, e["clock"])
                free_at = start + work
                gap_state = None
                busy_total += work
                seen = lands[(e["block"], e["role"])]  # in clock order
                at = bisect.bisect_left(seen, e["clock"])
                # its first product seen landed before the queue could finish that product
                if at < len(seen) and seen[at] < start + first - 0.05 * first:
                    late += 1
            last[(e["block"], e["role"])] = e["point"]
    idle_total = sum(idle_by_state.values())
    return {"span_cycles": span_total, "busy_cycles": busy_total, "idle_cycles": idle_total,
            "busy_share": busy_total / span_total if span_total else 0.0,
            "idle_share": idle_total / span_total if span_total else 0.0, "late_bursts": late,
            "idle_by_state": sorted(idle_by_state.items(), key=lambda kv: -kv[1]),
            "phases": item_phases(events, producer)}


# A work item's phases on a consumer role, in order: each ends at the first of its end points after its start.
# A schedule may start the next item (its Q, its first S) before this one's output is written, so an item's
# events run from its ITEM_START to its own ITEM_END; an item whose first S goes out beside the item before's
# last PV logs it as S_PV_ISSUED.
PHASES = ((("Q_LANDED",), "Q load"), (("S_ISSUED", "S_PV_ISSUED"), "turn, first S issued"), (("S_LANDED",), "first S"),
          (("SOFTMAX_DONE",), "first softmax"), (("KEYS_DONE",), "key loop"), (("ITEM_END",), "output"))


def item_phases(events: list[dict], producer: int | None) -> dict:
    """Median cycles of each phase of a work item (ITEM_START, then PHASES in turn), of the whole item, and
    from an item's end to the next one's start where the next starts later, over the consumer roles' items."""
    by_role = defaultdict(list)
    for e in events:
        if e["role"] != producer:
            by_role[(e["block"], e["role"])].append(e)
    spans = defaultdict(list)
    for role_events in by_role.values():
        role_events.sort(key=lambda e: e["n"])
        starts = [i for i, e in enumerate(role_events) if e["point"] == "ITEM_START"]
        for i, nxt in zip(starts, starts[1:] + [None]):
            item = role_events[i]["arg"]
            end = next((j for j in range(i + 1, len(role_events))
                        if role_events[j]["point"] == "ITEM_END" and role_events[j]["arg"] == item), None)
            if end is None:
                continue
            at, clock = i, role_events[i]["clock"]
            for points, name in PHASES:
                found = next((j for j in range(at + 1, end + 1) if role_events[j]["point"] in points), None)
                if found is None:
                    break
                spans[name].append(role_events[found]["clock"] - clock)
                at, clock = found, role_events[found]["clock"]
            else:
                spans["whole item"].append(clock - role_events[i]["clock"])
                if nxt is not None and role_events[nxt]["clock"] > clock:
                    spans["to the next item"].append(role_events[nxt]["clock"] - clock)
    return {name: statistics.median(v) for name, v in spans.items() if v}


def block_ends(events: list[dict]) -> dict:
    """When each traced block finished, on a clock all SMs share (clock="global"): per block the last ITEM_END of its
    consumer roles, from the first event of any block, and its items (the ITEM_ENDs of its first consumer role).
    span: the last block's end; idle_share: 1 - the mean end over span (the share of the blocks' SM time left
    idle at the grid's tail); by_items: per item count, the blocks and their least, median and largest end."""
    producer = producer_role(events)
    consumers = [e for e in events if e["role"] != producer]
    if not consumers:
        raise ValueError("events: no consumer role recorded")
    start = min(e["clock"] for e in events)
    first_role = {}
    for e in consumers:
        first_role[e["block"]] = min(first_role.get(e["block"], e["role"]), e["role"])
    ends, items = defaultdict(int), defaultdict(int)
    for e in consumers:
        if e["point"] == "ITEM_END":
            ends[e["block"]] = max(ends[e["block"]], e["clock"] - start)
            items[e["block"]] += e["role"] == first_role[e["block"]]
    if not ends:
        raise ValueError("events: no block finished an item")
    span = max(ends.values())
    by_items = defaultdict(list)
    for block, end in ends.items():
        by_items[items[block]].append(end)
    return {"span": span, "idle_share": 1 - statistics.mean(ends.values()) / span if span else 0.0,
            "by_items": {n: {"blocks": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)}
                         for n, v in sorted(by_items.items())}}


def run_traced(spec, xs: tuple, *, blocks: int = 132, events: int = 4096, clock: str = "sm", **call) -> list[dict]:
    """One call of `spec`'s kernel on xs (after a warm-up call) with its trace points recording; its events."""
    import cupy

    with traced_build(spec, blocks, events, clock) as kernel:
        out = cupy.empty_like(xs[0])
        kernel(*xs, out=out, **call)
        size = blocks * ROLES_MAX * events * 2
        address = kernel._module.get_global_var("qattn_trace_events")  # the module's array, as a device address
        memory = cupy.cuda.UnownedMemory(int(address), size * 8, kernel)
        buffer = cupy.ndarray((size,), cupy.uint64, cupy.cuda.MemoryPointer(memory, 0))
        buffer.fill(0)
        kernel(*xs, out=out, **call)
        cupy.cuda.runtime.deviceSynchronize()
        return decode(cupy.asnumpy(buffer), blocks, events)

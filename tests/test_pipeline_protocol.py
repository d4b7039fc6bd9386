"""The barrier protocol of the warp-specialized wgmma pipeline (templates/cuda/wgmma_attention.cuh.j2),
transcribed as a model and run under random schedules on the CPU: the producer's ring of K and V slots
(mbarriers waited on by phase parity), each consumer warpgroup's key loop in both of its orders (S ahead
of PV; PV first, S beside or after it) and, under PINGPONG, the warpgroups' turns on named barriers.
Every schedule must finish (no deadlock), never wait on an mbarrier two phases ahead of the phase it
means (parity aliasing), never let a copy land in a slot a wgmma still reads, and leave no arrival on a
turn barrier."""
from __future__ import annotations

import random

import pytest


class MBarrier:
    """An mbarrier: `count` arrivals complete a phase; a wait names the parity of the phase it needs."""

    def __init__(self, count: int):
        self.count, self.pending, self.phases = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.phases, self.pending = self.phases + 1, self.count

    def done(self, phase: int) -> bool:
        """mbar_wait(bar, phase & 1): true once the phase of that parity completed; the protocol must
        never let the barrier run two phases past the one waited for (the parity would alias)."""
        assert self.phases < phase + 2, f"waiting for phase {phase} of a barrier {self.phases} phases on"
        return (self.phases & 1) != (phase & 1)


class NamedBarrier:
    """bar.sync / bar.arrive over two warpgroups (the waiter's and the one before it): one unit each."""

    def __init__(self):
        self.arrived, self.generation = 0, 0

    def arrive(self):
        self.arrived += 1
        if self.arrived == 2:
            self.arrived, self.generation = 0, self.generation + 1

    def sync(self):
        target = self.generation + 1
        self.arrive()
        while self.generation < target:
            yield


def run(nblocks: int, stages: int, groups: int, *, qk_ahead: bool, s_beside_pv: bool, pingpong: bool, seed: int):
    rng = random.Random(seed)
    full = {side: [MBarrier(1) for _ in range(stages)] for side in "kv"}
    free = {side: [MBarrier(groups) for _ in range(stages)] for side in "kv"}  # a warp's lane 0 each: per group here
    turns = [NamedBarrier() for _ in range(groups)]
    copies = []  # landing callbacks of the copies in flight
    held = {}  # (side, slot) -> the block in it
    readers = {}  # (side, slot) -> wgmmas in flight reading it

    def produce():
        for j in range(nblocks):
            slot, reuse = j % stages, j // stages
            for side in "kv":
                if reuse > 0:
                    while not free[side][slot].done(reuse - 1):
                        yield
                assert readers.get((side, slot), 0) == 0, f"a copy into {side} slot {slot} while a wgmma reads it"

                def land(side=side, slot=slot, j=j):
                    held[side, slot] = j
                    full[side][slot].arrive()
                copies.append(land)
                yield

    def consume(wg):
        in_flight = []  # this warpgroup's wgmma groups in issue order

        def issue(side, slot, block):
            assert held.get((side, slot)) == block, f"wg {wg} reads block {block} from {side} slot {slot}"
            readers[side, slot] = readers.get((side, slot), 0) + 1
            in_flight.append((side, slot))

        def wait_group(keep):  # wgmma.wait_group keep: groups retire in order
            while len(in_flight) > keep:
                readers[in_flight.pop(0)] -= 1
                yield

        def turn_wait():
            if pingpong:
                yield from turns[wg].sync()

        def turn_pass():
            if pingpong:
                turns[(wg + 1) % groups].arrive()

        if pingpong and wg == groups - 1:
            turns[0].arrive()
        if nblocks > 0:
            while not full["k"][0].done(0):
                yield
            yield from turn_wait()
            issue("k", 0, 0)
            turn_pass()
            yield from wait_group(0)
            free["k"][0].arrive()
        for j in range(nblocks):
            nxt = j + 1 < nblocks
            slot, nslot = j % stages, (j + 1) % stages
            s_slot, s_block = (nslot, j + 1) if nxt else (slot, j)  # the last tile issues S of its own K again
            while not full["v"][slot].done(j // stages):
                yield
            if nxt:
                while not full["k"][nslot].done((j + 1) // stages):
                    yield
            if qk_ahead:
                yield from turn_wait()
                issue("k", s_slot, s_block)
                issue("v", slot, j)
                turn_pass()
                yield from wait_group(1)
                if nxt:
                    free["k"][nslot].arrive()
                yield from wait_group(0)
                free["v"][slot].arrive()
            else:
                issue("v", slot, j)
                if s_beside_pv:
                    issue("k", s_slot, s_block)
                yield from wait_group(1 if s_beside_pv else 0)
                free["v"][slot].arrive()
                if not s_beside_pv:
                    issue("k", s_slot, s_block)
                yield from wait_group(0)
                if nxt:
                    free["k"][nslot].arrive()
        if pingpong and wg == 0:
            yield from turns[0].sync()

    workers = {"producer": produce(), **{f"wg{w}": consume(w) for w in range(groups)}}
    for _ in range(100_000):
        if not workers:
            break
        pick = rng.choice(list(workers) + (["copy engine"] if copies else []))
        if pick == "copy engine":
            copies.pop(rng.randrange(len(copies)))()
            continue
        try:
            next(workers[pick])
        except StopIteration:
            del workers[pick]
    else:
        raise AssertionError(f"no way forward for {sorted(workers)}: a deadlock")
    assert all(t.arrived == 0 for t in turns), "an arrival left on a turn barrier"


ORDERS = {"S ahead of PV": (True, False), "PV, S beside it": (False, True), "PV, then S": (False, False)}


# turns are taken with S ahead of PV only (a static_assert in the template)
CASES = [(order, groups, pingpong) for order in ORDERS for groups in (1, 2, 3)
         for pingpong in ((False, True) if groups > 1 and ORDERS[order][0] else (False,))]


@pytest.mark.parametrize("order,groups,pingpong", CASES)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_schedule_finishes_without_aliasing_or_overwrites(order, groups, pingpong, stages):
    qk_ahead, s_beside_pv = ORDERS[order]
    for nblocks in (0, 1, 2, 3, 5, 8):
        for seed in range(25):
            run(nblocks, stages, groups, qk_ahead=qk_ahead, s_beside_pv=s_beside_pv, pingpong=pingpong, seed=seed)


@pytest.mark.parametrize("break_it, why", [
    ("no first pass", "a deadlock"),
    ("no last wait", "an arrival left"),
    ("K never freed", "a deadlock"),
])
def test_the_model_catches_a_broken_protocol(break_it, why, monkeypatch):
    """The checks can fail: a protocol without the last warpgroup's first pass deadlocks, one without
    warpgroup 0's last wait leaves an arrival, one that never frees a K slot in the loop stalls the ring."""
    source = {
        "no first pass": ("turns[0].arrive()\n        if nblocks > 0:", "None\n        if nblocks > 0:"),
        "no last wait": ("if pingpong and wg == 0:\n            yield from turns[0].sync()",
                         "if False:\n            yield from turns[0].sync()"),
        "K never freed": ("if nxt:\n                    free[\"k\"][nslot].arrive()\n                yield from wait_group(0)\n"
                         "                free[\"v\"][slot].arrive()",
                         "yield from wait_group(0)\n                free[\"v\"][slot].arrive()"),
    }[break_it]
    import inspect
    import textwrap

    text = textwrap.dedent(inspect.getsource(run))
    assert source[0] in text
    namespace = dict(globals())
    exec(compile(text.replace(source[0], source[1], 1), "broken", "exec"), namespace)
    with pytest.raises(AssertionError, match=why):
        for nblocks in (3, 5):
            for seed in range(10):
                namespace["run"](nblocks, 2, 2, qk_ahead=True, s_beside_pv=False, pingpong=True, seed=seed)

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


def run(items, stages: int, groups: int, *, qk_ahead: bool, s_beside_pv: bool, pingpong: bool, seed: int,
        one_body: bool = False):
    """One block's work: `items` key-tile counts, one per work item it takes in turn (a persistent block
    takes several; the ring's slots and phases run on across them: KvRing::base). one_body: the key loop
    on one body (ONE_BODY_KEY_LOOP), else its last tile a step of its own without S."""
    items = (items,) if isinstance(items, int) else tuple(items)
    rng = random.Random(seed)
    full = {side: [MBarrier(1) for _ in range(stages)] for side in "kv"}
    free = {side: [MBarrier(groups) for _ in range(stages)] for side in "kv"}  # a warp's lane 0 each: per group here
    turns = [NamedBarrier() for _ in range(groups)]
    copies = []  # landing callbacks of the copies in flight
    held = {}  # (side, slot) -> the block in it
    readers = {}  # (side, slot) -> wgmmas in flight reading it

    def produce():
        base = 0
        for nblocks in items:
            yield from produce_item(base, nblocks)
            base += nblocks

    def produce_item(base, nblocks):
        for j in range(nblocks):
            slot, reuse = (base + j) % stages, (base + j) // stages
            for side in "kv":
                if reuse > 0:
                    while not free[side][slot].done(reuse - 1):
                        yield
                assert readers.get((side, slot), 0) == 0, f"a copy into {side} slot {slot} while a wgmma reads it"

                def land(side=side, slot=slot, g=base + j):
                    held[side, slot] = g
                    full[side][slot].arrive()
                copies.append(land)
                yield

    def consume(wg):
        if pingpong and wg == groups - 1:  # consumer_turns_begin
            turns[0].arrive()
        base = 0
        for nblocks in items:
            yield from consume_item(wg, base, nblocks)
            base += nblocks
        if pingpong and wg == 0:  # consumer_turns_end
            yield from turns[0].sync()

    def consume_item(wg, base, nblocks):
        in_flight = []  # this warpgroup's wgmma groups in issue order

        def issue(side, slot, block):
            assert held.get((side, slot)) == block, f"wg {wg} reads block {block} from {side} slot {slot}"
            readers[side, slot] = readers.get((side, slot), 0) + 1
            in_flight.append((side, slot))

        def wait_group(keep):  # wgmma.wait_group keep: groups retire in order, each some time after its issue
            while len(in_flight) > keep:
                yield
                readers[in_flight.pop(0)] -= 1

        def turn_wait():
            if pingpong:
                yield from turns[wg].sync()

        def turn_pass():
            if pingpong:
                turns[(wg + 1) % groups].arrive()

        def slot(j):  # KvRing::slot
            return (base + j) % stages

        def phase(j):  # KvRing::phase
            return (base + j) // stages

        if nblocks > 0:
            while not full["k"][slot(0)].done(phase(0)):
                yield
            yield from turn_wait()
            issue("k", slot(0), base)
            turn_pass()
            yield from wait_group(0)
            if not one_body or nblocks > 1:  # one body: the last tile's K is freed after the loop
                free["k"][slot(0)].arrive()
        for j in range(nblocks):
            nxt = j + 1 < nblocks
            issues_s = nxt or one_body  # the last step of one body issues S of its own K again
            s_tile = j + 1 if nxt else j
            frees_next_k = j + 2 < nblocks if one_body else nxt
            while not full["v"][slot(j)].done(phase(j)):
                yield
            if nxt:
                while not full["k"][slot(j + 1)].done(phase(j + 1)):
                    yield
            if qk_ahead:
                yield from turn_wait()
                if issues_s:
                    issue("k", slot(s_tile), base + s_tile)
                issue("v", slot(j), base + j)
                turn_pass()
                if issues_s:
                    yield from wait_group(1)
                    if frees_next_k:
                        free["k"][slot(j + 1)].arrive()
                yield from wait_group(0)
                free["v"][slot(j)].arrive()
            else:
                beside = s_beside_pv and issues_s
                issue("v", slot(j), base + j)
                if beside:
                    issue("k", slot(s_tile), base + s_tile)
                yield from wait_group(1 if beside else 0)
                free["v"][slot(j)].arrive()
                if issues_s:
                    if not s_beside_pv:
                        issue("k", slot(s_tile), base + s_tile)
                    yield from wait_group(0)
                    if frees_next_k:
                        free["k"][slot(j + 1)].arrive()
        if one_body and nblocks > 0:  # the last tile's K, read again by the last step's S
            free["k"][slot(nblocks - 1)].arrive()

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
@pytest.mark.parametrize("one_body", [False, True], ids=["last step apart", "one body"])
def test_every_schedule_finishes_without_aliasing_or_overwrites(order, groups, pingpong, stages, one_body):
    qk_ahead, s_beside_pv = ORDERS[order]
    for items in (0, 1, 2, 3, 5, 8, (3, 1, 4), (2, 0, 5, 1), (7, 7, 2)):  # one work item, or several in turn
        for seed in range(25):
            run(items, stages, groups, qk_ahead=qk_ahead, s_beside_pv=s_beside_pv, pingpong=pingpong, seed=seed,
                one_body=one_body)


@pytest.mark.parametrize("break_it, why, one_body", [
    ("no first pass", "a deadlock", False),
    ("no last wait", "an arrival left", False),
    ("K never freed", "a deadlock", False),
    ("K freed before its S retired", "while a wgmma reads it", False),
    ("last K freed early", "while a wgmma reads it|reads block", True),
])
def test_the_model_catches_a_broken_protocol(break_it, why, one_body):
    """The checks can fail: a protocol without the last warpgroup's first pass deadlocks, one without
    warpgroup 0's last wait leaves an arrival, one that never frees a K slot in the loop stalls the ring, one
    that frees the first tile's K slot as soon as its S is issued lets a copy land under that read, and a loop
    on one body that frees the last tile's K before its last step reads it again lets the next work item's
    copy land under that read."""
    edits = {
        "no first pass": [("turns[0].arrive()\n        base = 0", "None\n        base = 0")],
        "no last wait": [("if pingpong and wg == 0:  # consumer_turns_end\n            yield from turns[0].sync()",
                          "if False:\n            yield from turns[0].sync()")],
        "K never freed": [("                    if frees_next_k:\n                        free[\"k\"][slot(j + 1)].arrive()\n"
                           "                yield from wait_group(0)", "                yield from wait_group(0)")],
        "K freed before its S retired": [
            ("            yield from wait_group(0)\n            if not one_body or nblocks > 1:",
             "            free[\"k\"][slot(0)].arrive()\n            yield from wait_group(0)\n            if False:")],
        # one body: every K freed as soon as its S landed, the last tile's too
        "last K freed early": [("if not one_body or nblocks > 1:", "if True:"),
                               ("frees_next_k = j + 2 < nblocks if one_body else nxt", "frees_next_k = nxt"),
                               ("if one_body and nblocks > 0:  # the last tile's K", "if False:  #")],
    }[break_it]
    import inspect
    import textwrap

    text = textwrap.dedent(inspect.getsource(run))
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    namespace = dict(globals())
    exec(compile(text, "broken", "exec"), namespace)
    with pytest.raises(AssertionError, match=why):
        for items in (3, 5, (2, 3), (3, 4, 2)):
            for seed in range(10):
                namespace["run"](items, 2, 2, qk_ahead=True, s_beside_pv=False, pingpong=True, seed=seed,
                                 one_body=one_body)

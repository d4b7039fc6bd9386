"""One sweep: check every candidate once, time the ones that pass in interleaved rounds, keep the
fastest. The GPU work comes in through prepare and timer, so that the choice itself is plain code."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

from ..bench.timing import round_timer, time_interleaved
from ..engine.tuned import TunedKernel


class Rejected(Exception):
    """A candidate that does not run, or runs wrong: its message says why."""


@dataclass
class SweepResult:
    times: dict[TunedKernel, float] = field(default_factory=dict)  # median ms of each candidate timed
    rejected: dict[TunedKernel, str] = field(default_factory=dict)  # why each of the others was not

    @property
    def winner(self) -> TunedKernel | None:
        """The fastest candidate timed; None where every one was rejected."""
        return min(self.times, key=self.times.get) if self.times else None


def sweep(specs, prepare: Callable, *, rounds: int = 2, timer: Callable | None = None,
          progress: Callable[[str], None] | None = None) -> SweepResult:
    """prepare(spec) runs the candidate once, checks its output and returns a callable that launches
    it again, or raises Rejected. The candidates that pass are timed in `rounds` interleaved rounds
    (bench.timing.time_interleaved: every candidate once a round, odd rounds in reverse, so that the
    clock drift of a power-capped GPU is shared by all); each keeps the median of its round times.
    timer(fn, rounds) -> ms (default: bench's round_timer). progress(line) after every step: one
    check per candidate, then one per timing round (len(specs) + rounds steps where any passed)."""
    timer = timer or round_timer
    report = progress or (lambda line: None)
    result, launches = SweepResult(), {}
    for spec in specs:
        kernel = TunedKernel.of(spec)
        try:
            launches[kernel] = prepare(spec)
        except Rejected as exc:
            result.rejected[kernel] = str(exc)
            report(f"{kernel.name} rejected: {exc}")
        else:
            report(f"{kernel.name} checked")
    fns, count = list(launches.values()), 0

    def timed(fn, n):
        nonlocal count
        ms, count = timer(fn, n), count + 1
        if count % len(fns) == 0:
            report(f"round {count // len(fns)} of {rounds} timed ({len(fns)} candidates)")
        return ms

    per_round = time_interleaved(fns, rounds, timed) if fns else []
    result.times = {kernel: statistics.median(times) for kernel, times in zip(launches, per_round)}
    return result

"""A whole tune: one sweep per (format, head dim, causal, shape) asked for, every candidate compiled
first (in parallel), then checked and timed on the current GPU; each winner is stored in the
tuned-tile table (engine/tuned.py) as its sweep ends, so that an interrupted run keeps what it found."""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Callable

from ..engine import tuned
from ..engine.spec import KernelSpec, builtin_spec
from .build import prebuild
from .candidates import candidate_specs
from .case import GpuCase, Shape
from .sweep import Rejected, sweep


@dataclass(frozen=True)
class Job:
    """One sweep: its key, the shape it times and the candidates."""

    format: str
    head_dim: int
    causal: bool
    shape: Shape
    specs: tuple[KernelSpec, ...]
    default_tile: str  # the name of the kernel the shape's calls run without a tuned table (the first of specs)

    @property
    def label(self) -> str:
        return f"{self.format} d{self.head_dim} {'causal' if self.causal else 'non-causal'} {self.shape.label}"


def plan(formats, head_dims, causals, shapes, arch: str, *, block_shapes=None, warps=None, stages=None,
         mma=None, options: bool = True) -> list[Job]:
    """The sweeps of a tune, every spec validated before any GPU work (errors name the argument). Each
    sweep's first candidate is the kernel its shape's calls run without a tuned table (builtin_spec: the
    family's kernel for that many query rows and sequence-heads, whatever the grid holds), so that no winner is stored that
    the sweep timed slower than what calls ran before."""
    jobs = []
    for fmt, d, causal in itertools.product(formats, head_dims, causals):
        grid = candidate_specs(fmt, d, causal, arch, block_shapes=block_shapes, warps=warps, stages=stages,
                               mma=mma, options=options)
        for shape in shapes:
            builtin = builtin_spec(fmt, d, causal, shape.queries, arch, shape.batch * shape.heads)
            specs = (builtin, *(spec for spec in grid if spec != builtin))
            jobs.append(Job(fmt, d, causal, shape, specs, tuned.TunedKernel.of(builtin).name))
    return jobs


def steps(jobs: list[Job], rounds: int) -> int:
    """How many progress lines run() reports: one per distinct candidate compiled, then per sweep one
    per candidate checked and one per timing round."""
    return len({spec for job in jobs for spec in job.specs}) + sum(len(job.specs) + rounds for job in jobs)


def run(jobs: list[Job], *, rounds: int = 2, seed: int = 0, build_jobs: int = 1,
        progress: Callable[[str], None] | None = None, case: Callable | None = None,
        timer: Callable | None = None) -> list[tuned.TunedEntry]:
    """Run the sweeps on the current GPU and store each winner; returns the entries stored.
    case(format, head_dim, causal, shape, seed) -> prepare(spec), sweep's (default: GpuCase);
    timer as sweep's."""
    device = tuned.current_device()
    if device is None:
        raise RuntimeError("tune: no CUDA GPU found; timing needs one")
    case = case or GpuCase
    report = progress or (lambda line: None)
    specs = list(dict.fromkeys(spec for job in jobs for spec in job.specs))
    compile_errors = prebuild(specs, build_jobs,
                              lambda spec, error: report(f"compiled {spec.name}" + (f": {error}" if error else "")))
    entries = []
    for job in jobs:
        prepare = case(job.format, job.head_dim, job.causal, job.shape, seed)

        def checked(spec, prepare=prepare):
            if spec in compile_errors:
                raise Rejected(compile_errors[spec])
            return prepare(spec)

        result = sweep(job.specs, checked, rounds=rounds, timer=timer,
                       progress=lambda line, job=job: report(f"{job.label}: {line}"))
        if result.winner is None:
            raise ValueError(f"tile: every candidate of {job.label} was rejected: " +
                             "; ".join(f"{kernel.name}: {why}" for kernel, why in result.rejected.items()))
        entry = tuned.TunedEntry(
            device, job.specs[0].arch, job.format, job.head_dim, job.causal, job.shape.shape_class, result.winner,
            candidates={kernel.name: ms for kernel, ms in result.times.items()}, shape=dataclasses.asdict(job.shape),
            rejected={kernel.name: why for kernel, why in result.rejected.items()}, default_tile=job.default_tile,
            tuned_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
        tuned.save([entry])
        entries.append(entry)
    return entries

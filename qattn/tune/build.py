"""Compiling a sweep's candidates into the kernel cache in parallel, before the GPU work starts."""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable

from ..engine.cache import KernelNotCached
from ..engine.compile import CompileError
from ..engine.kernel import build_kernel
from ..engine.spec import KernelSpec


def compile_error(spec: KernelSpec) -> str | None:
    """Build spec into the kernel cache; why it failed, or None (`qattn inspect` shows a failed
    spec's whole compiler log)."""
    try:
        build_kernel(spec)
    except CompileError as exc:
        return "compile: " + next((line.strip() for line in exc.log.splitlines() if "error" in line), "failed")
    except KernelNotCached as exc:
        return str(exc)
    return None


def prebuild(specs: list[KernelSpec], jobs: int, done: Callable[[KernelSpec, str | None], None]) -> dict:
    """Compile specs in `jobs` processes (NVRTC holds the GIL: threads would take turns); done(spec,
    error) as each finishes. Returns spec -> compile error, for those that failed."""
    errors = {}

    def finish(spec, error):
        if error is not None:
            errors[spec] = error
        done(spec, error)

    if jobs <= 1 or len(specs) <= 1:
        for spec in specs:
            finish(spec, compile_error(spec))
        return errors
    # spawn: a fresh interpreter per worker, which never touches the GPU (compiling needs none)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=spawn) as pool:
        futures = {pool.submit(compile_error, spec): spec for spec in specs}
        for future in as_completed(futures):
            finish(futures[future], future.result())
    return errors

"""What the offline HIP decode tests share: clang (they skip without it), each spec built and disassembled once,
the matrix instructions by operand type and target, opcode counts in a disassembly, and device functions cut from a rendered source and built into a host library
to run through ctypes."""
from __future__ import annotations

import ctypes
import functools
import re
import subprocess

import pytest

from qattn.engine.compile import compile_hip_offline, disassemble, find_tool, functions_by_symbol
from qattn.engine.inspect import HIP_MATRIX_OPS as MATRIX_OP  # noqa: F401  (the tests' table)
from qattn.engine.registry import recipe
from qattn.engine.render import render
from qattn.engine.spec import KernelSpec

CLANG = find_tool("clang++-19", "clang++-20", "clang++")

needs_clang = pytest.mark.skipif(CLANG is None, reason="offline HIP compiles need clang-19 (.ci/run installs it)")

WAVE = {"gfx90a": 64, "gfx942": 64, "gfx1100": 32, "gfx1201": 32}


def query_types(fmt: str) -> list[str]:
    """The query types of a decode format, as its HIP entries are suffixed (_f16, _bf16)."""
    return ["bf16" if dtype == "bfloat16" else "f16" for dtype in recipe(fmt, "decode").input_dtypes]


@functools.lru_cache(maxsize=None)
def built(spec: KernelSpec):
    """The spec's offline build and its disassembly by function symbol."""
    binary = compile_hip_offline(render(spec), spec.arch, spec.name)
    return binary, functions_by_symbol(disassemble(binary.data, "hip"))


def op_count(op: str, text: str) -> int:
    return len(re.findall(rf"\b{op}\b", text))


def cut_function(source: str, signature: str) -> str:
    """One device function of a rendered source, from its signature to its closing brace."""
    m = re.search(re.escape(signature) + r"( \{[^\n]*\}\n|.*?\n\}\n)", source, re.S)
    assert m, signature
    return m.group(0)


def host_library(folder, text: str, flags: list[str]) -> ctypes.CDLL:
    """C++ text (with extern "C" entry points) compiled by clang at -O2 with flags into a shared library in
    folder; the test skips where the host has no linker."""
    src, obj, lib = folder / "host.cpp", folder / "host.o", folder / "host.so"
    src.write_text(text)
    run = subprocess.run([CLANG, "-x", "c++", "-std=c++17", "-O2", *flags, "-fPIC", "-c", str(src), "-o", str(obj)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    run = subprocess.run([CLANG, "-shared", str(obj), "-o", str(lib)], capture_output=True, text=True)
    if run.returncode != 0:
        pytest.skip(f"no host linker: {run.stderr[-500:]}")
    return ctypes.CDLL(str(lib))

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


# A host stand-in for the block machinery a GPU kernel without matrix instructions uses, so that tests can run its
# device code on the CPU (host_library): each thread of a block a std::thread, the block barrier a std::barrier, the
# lane exchange (lane_xor, xor_lanes) through an array between two barriers of the thread's 32-lane group (a group
# runs its own work, as a half wave64 or a wave32 does) or, for a mask of 32, of its 64-lane wave; host atomics and fences for the HIP ones, the grid's sizes;
# launch(blocks_x, blocks_y, blocks_z, threads, kernel) runs the blocks one after another. Build with
# HOST_FLAGS.
HOST_BLOCKS = r"""
#include <barrier>
#include <cmath>
#include <memory>
#include <thread>
#include <vector>
#define __global__
#define __launch_bounds__(threads)
#define __shared__ static
#define QATTN_DEVICE static inline
#define __HIP_MEMORY_SCOPE_WORKGROUP 0
#define __HIP_MEMORY_SCOPE_AGENT 0
#define __hip_atomic_fetch_add(p, v, order, scope) __atomic_fetch_add(p, v, order)
#define __hip_atomic_load(p, order, scope) __atomic_load_n(p, order)
#define __builtin_amdgcn_fence(order, scope) __atomic_thread_fence(order)
#define __builtin_amdgcn_grid_size_x() host_grid_size[0]
#define __builtin_amdgcn_grid_size_y() host_grid_size[1]
typedef long long i64;
typedef unsigned u32;
typedef unsigned short u16;
typedef _Float16 f16;
struct HostThread { int tid, bx, by, bz; };
static thread_local HostThread host_thread;
static int host_grid[3];
static unsigned host_grid_size[2];  // work-items along x, y
static std::barrier<>* host_block_barrier;
static std::barrier<>* host_group_barriers[32];  // per 32 threads
static std::barrier<>* host_wave64_barriers[16];  // per 64 threads: exchanges across a wave64's halves
static unsigned host_lanes[1024];
QATTN_DEVICE int thread_id() { return host_thread.tid; }
QATTN_DEVICE int block_x() { return host_thread.bx; }
QATTN_DEVICE int block_y() { return host_thread.by; }
QATTN_DEVICE int block_z() { return host_thread.bz; }
QATTN_DEVICE int grid_blocks_x() { return host_grid[0]; }
QATTN_DEVICE int grid_blocks_y() { return host_grid[1]; }
QATTN_DEVICE void block_sync() { host_block_barrier->arrive_and_wait(); }
template <class T>
QATTN_DEVICE T lane_xor(T x, int lane, int mask) {
    std::barrier<>& group = mask < 32 ? *host_group_barriers[thread_id() / 32] : *host_wave64_barriers[thread_id() / 64];
    host_lanes[thread_id()] = __builtin_bit_cast(unsigned, x);
    group.arrive_and_wait();
    const unsigned y = host_lanes[thread_id() - lane + (lane ^ mask)];
    group.arrive_and_wait();
    return __builtin_bit_cast(T, y);
}
QATTN_DEVICE float xor_lanes(float x, int mask) { return lane_xor(x, thread_id() % 32, mask); }
template <class Kernel>
static void launch(int blocks_x, int blocks_y, int blocks_z, int threads, Kernel kernel) {
    host_grid[0] = blocks_x, host_grid[1] = blocks_y, host_grid[2] = blocks_z;
    host_grid_size[0] = blocks_x * threads, host_grid_size[1] = blocks_y;
    for (int z = 0; z < blocks_z; ++z)
        for (int y = 0; y < blocks_y; ++y)
            for (int x = 0; x < blocks_x; ++x) {
                std::barrier<> block(threads);
                std::vector<std::unique_ptr<std::barrier<>>> groups;
                for (int width : {32, 64})
                    for (int g = 0; g < (threads + width - 1) / width; ++g) {
                        const int n = threads - width * g < width ? threads - width * g : width;
                        groups.push_back(std::make_unique<std::barrier<>>(n));
                        (width == 32 ? host_group_barriers : host_wave64_barriers)[g] = groups.back().get();
                    }
                host_block_barrier = &block;
                std::vector<std::thread> team;
                for (int t = 0; t < threads; ++t)
                    team.emplace_back([=] { host_thread = {t, x, y, z}; kernel(); });
                for (auto& member : team) member.join();
            }
}
"""
# The scalar names the GPU headers (cuda/common.cuh.j2, hip/common.h.j2) give code both backends share, on the host
# (after HOST_BLOCKS): IEEE fp32 (HOST_FLAGS builds without FMA contraction), full-precision exp2, rint to nearest
# even, the max and the scale rule that keep a NaN, fp16 and bf16 widened to fp32.
HOST_SCALARS = r"""
QATTN_DEVICE float fmul_rn(float a, float b) { return a * b; }
QATTN_DEVICE float fadd_rn(float a, float b) { return a + b; }
QATTN_DEVICE float fsub_rn(float a, float b) { return a - b; }
QATTN_DEVICE float fdiv_rn(float a, float b) { return a / b; }
QATTN_DEVICE float fma_f32(float a, float b, float c) { return std::fma(a, b, c); }
QATTN_DEVICE float max_f32(float a, float b) { return std::fmax(a, b); }
QATTN_DEVICE float exp2_f32(float x) { return std::exp2(x); }
QATTN_DEVICE float abs_f32(float x) { return std::fabs(x); }
QATTN_DEVICE int rint_i32(float x) { return static_cast<int>(std::nearbyint(x)); }
QATTN_DEVICE float nan_max(float a, float b) { return a != a || b != b ? NAN : std::fmax(a, b); }
QATTN_DEVICE float nan_unless_finite(float x) { return std::fabs(x) <= 3.40282347e38f ? x : NAN; }
template <bool BF16>
QATTN_DEVICE float to_float(u16 x) {
    if constexpr (BF16) return __builtin_bit_cast(float, static_cast<u32>(x) << 16);
    return static_cast<float>(__builtin_bit_cast(f16, x));
}
"""
HOST_FLAGS = ["-std=c++20", "-ffp-contract=off", "-pthread"]

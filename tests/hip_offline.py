"""What the offline HIP tests share: clang (they skip without it), each spec built and disassembled once, the matrix
instructions by operand type and target, opcode counts in a disassembly, device functions cut from a rendered source
and built into a host library to run through ctypes, and host stand-ins for a GPU block, the headers' scalar names
and the HIP headers themselves (matrix ops included), under which whole HIP kernels run on the CPU."""
from __future__ import annotations

import ctypes
import functools
import re
import subprocess

import jinja2
import pytest

from qattn.engine.compile import compile_hip_offline, disassemble, find_tool, functions_by_symbol
from qattn.engine.inspect import HIP_MATRIX_OPS as MATRIX_OP  # noqa: F401  (the tests' table)
from qattn.engine.registry import recipe
from qattn.engine.render import environment, render
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
#define QATTN_DEVICE inline
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
QATTN_DEVICE int grid_blocks_z() { return host_grid[2]; }
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
// fp32 -> bf16, nearest even (a NaN stays a quiet NaN): the conversion clang calls on the host, which the GCC 12
// runtime lacks; the GPU converts in its own instruction.
extern "C" __bf16 __truncsfbf2(float f) {
    const u32 u = __builtin_bit_cast(u32, f);
    const u16 h = f != f ? static_cast<u16>((u >> 16) | 0x40u) : static_cast<u16>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return __builtin_bit_cast(__bf16, h);
}
"""
HOST_FLAGS = ["-std=c++20", "-ffp-contract=off", "-pthread"]


# ---- whole HIP kernels on the host ------------------------------------------------------------------------------
# The online-softmax step and the LSE as the GPU headers compute them, with full-precision exp2 and log2 (after
# common/rows.h.j2 and QATTN_NEG_INF; a Jinja template: it takes ln2).
HOST_SOFTMAX = r"""
QATTN_DEVICE float fast_exp2(float x) { return std::exp2(x); }
struct SoftmaxStep { float max, shift, rescale; };
template <bool kFast = true>
QATTN_DEVICE SoftmaxStep softmax_step(float running_max, float tile_max) {
    SoftmaxStep s;
    s.max = std::fmax(running_max, tile_max);
    s.shift = s.max == QATTN_NEG_INF ? 0.f : s.max;
    s.rescale = std::exp2(running_max - s.shift);
    return s;
}
QATTN_DEVICE float lse_from(float row_max, float row_sum) {
    return saw_keys(row_sum) ? (row_max + std::log2(row_sum)) * {{ ln2 }}f : QATTN_NEG_INF;
}
"""

# hip/common.h.j2 on the host, as the GPU target `target` (its macro defined, so target-gated code takes that
# target's branch): the block machinery and scalars above, the softmax step and LSE with full-precision exp2 and log2,
# and the few AMD builtins the kernels call outside the matrix headers.
HOST_HIP_COMMON = HOST_BLOCKS + HOST_SCALARS + r"""
#define __{{ host_target }}__ 1
#define QATTN_NEG_INF (-INFINITY)
#define __builtin_amdgcn_readfirstlane(x) (x)
#define __builtin_amdgcn_sched_barrier(mask) ((void)0)
#define __builtin_amdgcn_wavefrontsize() WAVE
typedef _Float16 f16x8 __attribute__((ext_vector_type(8)));
{% include "common/rows.h.j2" %}
""" + HOST_SOFTMAX + r"""// The matrix ops (the builtins of hip/matrix16.h.j2 and hip/matrix8.h.j2 name them), defined after those headers.
template <int KIND, class A, class D>
D host_mma(A a, A b, D d);
QATTN_DEVICE int host_cvt_pk_fp8(float x0, float x1, int old, bool high);
#define __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, d, ...) host_mma<0>(a, b, d)
#define __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, d, ...) host_mma<1>(a, b, d)
#define __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(a, b, d) host_mma<0>(a, b, d)
#define __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(a, b, d) host_mma<1>(a, b, d)
#define __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(a, b, d) host_mma<0>(a, b, d)
#define __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(a, b, d) host_mma<1>(a, b, d)
#define __builtin_amdgcn_mfma_i32_16x16x16i8(a, b, d, ...) host_mma<2>(a, b, d)
#define __builtin_amdgcn_mfma_i32_16x16x32_i8(a, b, d, ...) host_mma<2>(a, b, d)
#define __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(sa, a, sb, b, d, clamp) host_mma<2>(a, b, d)
#define __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32_gfx12(sa, a, sb, b, d, clamp) host_mma<2>(a, b, d)
#define __builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8(a, b, d, ...) host_mma<3>(a, b, d)
#define __builtin_amdgcn_wmma_f32_16x16x16_fp8_fp8_w32_gfx12(a, b, d) host_mma<3>(a, b, d)
#define __builtin_amdgcn_cvt_pk_fp8_f32(x0, x1, old, high) host_cvt_pk_fp8(x0, x1, old, high)
"""

# After hip/matrix8.h.j2 (or matrix16 alone): the matrix ops as their fragment layouts define them. A lane publishes
# its A and B fragments, the wave meets at a barrier, and each lane sums its D elements from the lanes that hold
# the row of A and the column of B: A's row / B's column l % 16, K consecutive k from the layout's first k for the
# lane (replicated copies must be equal), D's column l % 16 at rows frag_row(l, i). KIND 0 / 1: fp16 / bf16 (as 16-bit integers) with 16 k; 2: int8
# (exact int32 sums); 3: fp8, e4m3fnuz on gfx942 and OCP e4m3fn elsewhere; 2 and 3 take K8 k. The products are
# summed in double and added to D in fp32 (the hardware's order within an op is its own).
HOST_MMA = r"""
static float host_a[1024][32], host_b[1024][32];
QATTN_DEVICE void host_wave_barrier() {
    (WAVE == 64 ? *host_wave64_barriers[thread_id() / 64] : *host_group_barriers[thread_id() / 32]).arrive_and_wait();
}
static float host_fp8_value(unsigned char c) {
    const int e = (c >> 3) & 15, m = c & 7;
#if defined(__gfx942__)
    if (c == 0x80) return NAN;
    const float v = e == 0 ? m * 0x1p-10f : std::ldexp(1.f + m * 0.125f, e - 8);
#else
    if (e == 15 && m == 7) return NAN;
    const float v = e == 0 ? m * 0x1p-9f : std::ldexp(1.f + m * 0.125f, e - 7);
#endif
    return (c & 0x80) ? -v : v;
}
// x as the target's e4m3 byte, nearest with ties to the even code; |x| <= the format's largest (callers clamp).
static unsigned char host_fp8_code(float x) {
    int best = 0;
    for (int c = 1; c < 256; ++c) {
        const float v = host_fp8_value(c), w = host_fp8_value(best);
        if (v != v) continue;
        const float dv = std::fabs(v - x), dw = std::fabs(w - x);
        if (dv < dw || (dv == dw && (c & 1) == 0 && (best & 1) == 1)) best = c;
    }
    return best;
}
QATTN_DEVICE int host_cvt_pk_fp8(float x0, float x1, int old, bool high) {
    const unsigned pair = host_fp8_code(x0) | host_fp8_code(x1) << 8;
    return high ? (int)((old & 0xffff) | pair << 16) : (int)((old & 0xffff0000u) | pair);
}
template <int KIND, class A, class D>
D host_mma(A a, A b, D d) {
    constexpr bool EIGHT = KIND >= 2;
    constexpr int K = EIGHT ? HOST_K8 : 16, PER = sizeof(A) / (EIGHT ? 1 : 2);  // depth; k a lane holds
    const int t = thread_id(), lane = t % WAVE, base = t - lane;
    auto value = [](const A& x, int i) -> float {
        if constexpr (KIND == 0) return (float)x[i];
        if constexpr (KIND == 1) return to_float<true>((u16)x[i]);
        unsigned char bytes[sizeof(A)];
        __builtin_memcpy(bytes, &x, sizeof(A));
        return KIND == 2 ? (float)(signed char)bytes[i] : host_fp8_value(bytes[i]);
    };
    for (int i = 0; i < PER; ++i) host_a[t][i] = value(a, i), host_b[t][i] = value(b, i);
    host_wave_barrier();
    // A's row / B's column `index` at depth k; where the layout replicates it (RDNA3: both half-waves hold every
    // k), the copies must agree, or the element is NaN
    auto held = [&](float (*frags)[32], int index, int k) -> float {
        float x = NAN;
        bool found = false;
        for (int l = index; l < WAVE; l += 16) {
            const int k0 = EIGHT ? HOST_K0_8(l) : frag_k0(l);
            if (k0 > k || k >= k0 + PER) continue;
            const float y = frags[base + l][k - k0];
            if (found && __builtin_bit_cast(u32, y) != __builtin_bit_cast(u32, x)) return NAN;
            x = y, found = true;
        }
        return x;
    };
    D out = d;
    for (int i = 0; i < ND; ++i) {
        const int row = frag_row(lane, i), col = lane % 16;
        double sum = 0.0;
        for (int k = 0; k < K; ++k) sum += (double)held(host_a, row, k) * (double)held(host_b, col, k);
        if constexpr (KIND == 2) out[i] = d[i] + (int)sum;
        else out[i] = d[i] + (float)sum;
    }
    host_wave_barrier();
    return out;
}
"""


def host_hip_environment(target: str, eight: bool) -> jinja2.Environment:
    """An environment that renders HIP templates for the host as `target` (gfx90a, gfx942, gfx1100, gfx1201):
    hip/common.h.j2 replaced by HOST_HIP_COMMON and the matrix headers kept, followed by HOST_MMA (after matrix8
    where the kernel takes 8-bit ops: eight). Build what it renders with HOST_FLAGS."""
    real = environment()
    source = lambda name: real.loader.get_source(real, name)[0]  # noqa: E731
    header = "hip/matrix8.h.j2" if eight else "hip/matrix16.h.j2"
    depth = "#define HOST_K8 K8\n#define HOST_K0_8(l) frag8_k0(l)\n" if eight else \
        "#define HOST_K8 16\n#define HOST_K0_8(l) frag_k0(l)\n"  # (no 8-bit ops: never taken)
    overlay = {"hip/common.h.j2": HOST_HIP_COMMON.replace("{{ host_target }}", target),
               header: source(header) + depth + HOST_MMA}
    return jinja2.Environment(loader=jinja2.ChoiceLoader([jinja2.DictLoader(overlay), real.loader]),
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                              keep_trailing_newline=True)

"""What a plain reader of a paged KV cache attains on this GPU: a kernel that only streams the cache's
pages, in the decode kernel's pattern, beside a copy of the same GPU. A decode kernel that reads well
below it is held back by its own work, not by the memory system; it is a reference, not a strict
bound (a decode kernel's copies can beat it by a few percent).

The pools are laid out as PagedKVCache lays them out: a (page, kv head) holds one contiguous K piece
(page_size rows) and one contiguous V piece, kv heads adjacent within a page. Blocks come in
groups of kv_heads, one block per kv head, each group over its own share of the pages in shuffled
order, so that the blocks of a page's kv heads stream side by side as the decode kernel's splits do.
Each block copies STAGE_BYTES a step into a ring of shared memory with 16-byte cp.async copies that
fetch whole 128-byte L2 lines (the decode kernel's copies), waits for the oldest slot, refills, and
reads the slot back (an xor of every word, so that nothing is optimized away and a test can check
what was read). The reader runs at several depths of that ring (slots x blocks per SM); the fastest
is what the table reports, the others show how the stream depends on the bytes in flight. Token
scales are not read (1.5% of an 8-bit cache's bytes at D128).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..formats.decode.recipes import EIGHT_BIT, sides

STAGE_BYTES = 16 * 1024  # bytes a block copies per step
THREADS = 128
DEPTHS = ((2, 4), (2, 6), (3, 4))  # (slots, blocks per SM): 64, 96, 128 KiB in flight per SM

SOURCE = r"""
// Streams each block's pages: chunk c of the block's stream is 16-byte chunk c % CH of page c / CH, its
// first K_CH chunks in the K pool, the rest in the V pool.
template <int K_BYTES, int V_BYTES, int STAGES>
__device__ void stream(const unsigned char* k_pool, const unsigned char* v_pool, const int* pages, int per_block,
                       int kv_heads, unsigned* out) {
    extern __shared__ __align__(16) unsigned char ring[];
    constexpr int K_CH = K_BYTES / 16, CH = (K_BYTES + V_BYTES) / 16, STEP_CH = {{STAGE}} / 16;
    const int tid = threadIdx.x, kv_head = blockIdx.x % kv_heads;
    const int* mine = pages + (long long)(blockIdx.x / kv_heads) * per_block;
    const int steps = (int)((long long)per_block * CH / STEP_CH);
    const unsigned base = (unsigned)__cvta_generic_to_shared(ring);
    auto load = [&](int step) {
        const unsigned slot = base + (step % STAGES) * {{STAGE}};
#pragma unroll
        for (int j = 0; j < STEP_CH / {{THREADS}}; ++j) {
            const int i = tid + j * {{THREADS}};
            const long long c = (long long)step * STEP_CH + i;
            const int within = (int)(c % CH);
            const long long piece = (long long)mine[c / CH] * kv_heads + kv_head;
            const unsigned char* src = within < K_CH ? k_pool + piece * K_BYTES + within * 16
                                                     : v_pool + piece * V_BYTES + (within - K_CH) * 16;
            asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(slot + i * 16), "l"(src));
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load(s);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    uint4 acc = make_uint4(0u, 0u, 0u, 0u);
    for (int step = 0; step < steps; ++step) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        __syncthreads();
        if (step + STAGES - 1 < steps) load(step + STAGES - 1);
        asm volatile("cp.async.commit_group;\n" ::);
        const uint4* slot = reinterpret_cast<const uint4*>(ring + (step % STAGES) * {{STAGE}});
#pragma unroll
        for (int j = 0; j < STEP_CH / {{THREADS}}; ++j) {
            const uint4 w = slot[tid + j * {{THREADS}}];
            acc.x ^= w.x; acc.y ^= w.y; acc.z ^= w.z; acc.w ^= w.w;
        }
    }
    out[blockIdx.x * {{THREADS}} + tid] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}

extern "C" __global__ void __launch_bounds__({{THREADS}}) paged_read(const unsigned char* k_pool,
        const unsigned char* v_pool, const int* pages, int per_block, int kv_heads, unsigned* out) {
    stream<{{K_BYTES}}, {{V_BYTES}}, {{STAGES}}>(k_pool, v_pool, pages, per_block, kv_heads, out);
}
"""


def piece_bytes(fmt: str, page_size: int, head_dim: int) -> tuple[int, int]:
    """Bytes of one (page, kv head)'s K piece and V piece in a cache of format K-V."""
    return tuple(page_size * head_dim * (1 if side in EIGHT_BIT else 2) for side in sides(fmt))


def source(k_bytes: int, v_bytes: int, stages: int) -> str:
    """The reader's CUDA source for pieces of k_bytes and v_bytes and `stages` ring slots."""
    if stages < 2:
        raise ValueError(f"stages: expected at least 2 ring slots, got {stages}")
    for name, n in (("k_bytes", k_bytes), ("v_bytes", v_bytes)):
        if n <= 0 or n % 16:
            raise ValueError(f"{name}: expected a positive multiple of 16 bytes, got {n}")
    text = SOURCE
    for key, value in (("STAGE", STAGE_BYTES), ("THREADS", THREADS), ("K_BYTES", k_bytes), ("V_BYTES", v_bytes),
                       ("STAGES", stages)):
        text = text.replace("{{" + key + "}}", str(value))
    return text


def block_pages(pages: int, blocks: int, kv_heads: int, rng) -> tuple[np.ndarray, int]:
    """Each group of kv_heads blocks' page ids, shuffled, a group's ids contiguous: (ids [groups *
    per_group] int32, per_group). Every page is read by at most one group."""
    if blocks % kv_heads:
        raise ValueError(f"blocks: {blocks} is not a multiple of kv_heads {kv_heads}")
    groups = blocks // kv_heads
    per_group = pages // groups
    if per_group < 1:
        raise ValueError(f"pages: {pages} pages cannot give each of {groups} block groups one")
    return rng.permutation(pages)[:groups * per_group].astype(np.int32), per_group


@dataclass(frozen=True)
class Depth:
    stages: int
    blocks_per_sm: int


class Reader:
    """The reader of one piece pair at one ring depth on the current device: compiled once, launched on
    pools given by the caller."""

    def __init__(self, k_bytes: int, v_bytes: int, depth: Depth):
        import cupy
        from cupy.cuda import runtime

        self.k_bytes, self.v_bytes, self.depth = k_bytes, v_bytes, depth
        module = cupy.RawModule(code=source(k_bytes, v_bytes, depth.stages), options=("-std=c++17",))
        self.function = module.get_function("paged_read")
        device = cupy.cuda.runtime.getDevice()
        attr = lambda a: runtime.deviceGetAttribute(a, device)  # noqa: E731
        self.sms = attr(runtime.cudaDevAttrMultiProcessorCount)
        need = depth.stages * STAGE_BYTES
        per_sm = attr(runtime.cudaDevAttrMaxSharedMemoryPerMultiprocessor)
        reserved = attr(runtime.cudaDevAttrReservedSharedMemoryPerBlock)
        most = attr(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin)
        self.shared = min(most, max(need, per_sm // depth.blocks_per_sm - reserved))
        self.function.max_dynamic_shared_size_bytes = self.shared
        self.resident = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(self.function.kernel.ptr, THREADS,
                                                                                     self.shared)

    def blocks(self, kv_heads: int) -> int:
        """Blocks of one launch: one wave of the resident blocks, whole groups of kv_heads."""
        return self.sms * self.resident // kv_heads * kv_heads

    def __call__(self, k_pool, v_pool, pages, per_block: int, kv_heads: int, out) -> None:
        self.function((out.size // THREADS,), (THREADS,),
                      (k_pool, v_pool, pages, np.int32(per_block), np.int32(kv_heads), out), shared_mem=self.shared)

    def bytes_read(self, blocks: int, per_block: int) -> int:
        """Bytes a launch of `blocks` blocks of per_block pages reads (whole steps only)."""
        chunks = (self.k_bytes + self.v_bytes) // 16
        steps = per_block * chunks // (STAGE_BYTES // 16)
        return blocks * steps * STAGE_BYTES


def paged_read(fmt: str, page_size: int, head_dim: int, *, kv_heads: int = 8, pool_bytes: int = 1 << 30,
               depths=DEPTHS, seed: int = 0) -> list[dict]:
    """GB/s of the reader at each depth over pools of about pool_bytes (K and V together) of cache
    format `fmt`, each with its fraction of the copy bandwidth measured in the same run."""
    import cupy

    from .decode import copy_bandwidth
    from .timing import time_cuda

    k_bytes, v_bytes = piece_bytes(fmt, page_size, head_dim)
    pages = pool_bytes // ((k_bytes + v_bytes) * kv_heads)
    k_pool = cupy.ones(pages * kv_heads * k_bytes // 4, dtype=cupy.float32)
    v_pool = cupy.ones(pages * kv_heads * v_bytes // 4, dtype=cupy.float32)
    copy_gbs = copy_bandwidth()
    rng = np.random.default_rng(seed)
    records = []
    for stages, blocks_per_sm in depths:
        reader = Reader(k_bytes, v_bytes, Depth(stages, blocks_per_sm))
        blocks = reader.blocks(kv_heads)
        ids, per_block = block_pages(pages, blocks, kv_heads, rng)
        ids = cupy.asarray(ids)
        out = cupy.empty(blocks * THREADS, dtype=cupy.uint32)
        ms = time_cuda(lambda: reader(k_pool, v_pool, ids, per_block, kv_heads, out), runs=10, min_ms=50.0).median_ms
        gbs = reader.bytes_read(blocks, per_block) / (ms * 1e-3) / 1e9
        records.append({"format": fmt, "page_size": page_size, "head_dim": head_dim, "kv_heads": kv_heads,
                        "k_piece": k_bytes, "v_piece": v_bytes, "stages": stages, "blocks_per_sm": reader.resident,
                        "in_flight_kib": (stages - 1) * reader.resident * STAGE_BYTES // 1024, "ms": ms, "gbs": gbs,
                        "copy_gbs": copy_gbs, "of_copy": gbs / copy_gbs})
    return records


def fastest(records: list[dict]) -> dict:
    """The fastest depth's record."""
    return max(records, key=lambda r: r["gbs"] if math.isfinite(r["gbs"]) else -1.0)

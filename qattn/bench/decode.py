"""The decode benchmark: qattn's paged decode in each cache format (and on each QK path asked for)
beside torch SDPA's flash and cuDNN backends on the same queries over the same K/V in fp16 (dense),
FlashInfer's paged decode over the same tokens in pages of the same size (fp16, and e4m3 with one
scale per tensor; bench/paged_peers.py), and a plain copy for the bandwidth ceiling, all in the same
run in interleaved rounds (DESIGN §4). Bandwidth is the bytes that must cross HBM once: K and V codes,
their scales and the block table (qattn); fp16 or e4m3 K and V (the peers). A sweep times operating points (Point) L2-warm (L2 as the
previous call of the same implementation left it) and/or HBM-cold (L2 evicted before every timed
call); either way a GPU spin ahead of each timed call covers the host's time to enqueue it, so the
CUDA events time the GPU alone. The presets are the decode contract's grid and a small smoke grid.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import numpy as np

from .paged_peers import PAGED_PEERS, paged_peer
from .peers import peer
from .timing import GpuSpin, L2Flush, time_cuda, time_cuda_after, time_interleaved, with_ratios

SDPA_PEERS = ("sdpa_flash", "sdpa_cudnn")
DECODE_PEERS = SDPA_PEERS + PAGED_PEERS  # those whose library is missing are left out of a run
DEFAULT_FORMATS = ("f16-f16", "e4m3-e4m3", "i8-i8", "e4m3-f16", "f16-e4m3")
DEFAULT_SHAPES = ((8, 32768), (64, 4096), (1, 131072))
L2_MODES = ("warm", "cold")
GQA_RATIOS = (1, 4, 8)
# Every preset point's caches live at once (they are timed interleaved): the f16-f16 cache, the fp16
# K/V it is written from, the peers' dense copy and six 8-bit caches come to about 7x the fp16 K/V.
PRESET_MAX_KV_BYTES = 8 << 30


def contract_formats(codes=("e4m3", "i8")) -> tuple[str, ...]:
    """The decode contract's dtype controls, K16/V16 and for each 8-bit code K8/V16, K16/V8, K8/V8."""
    names = ["f16-f16"]
    for code in codes:
        names += [f"{code}-f16", f"f16-{code}", f"{code}-{code}"]
    return tuple(names)


@dataclass(frozen=True)
class Point:
    """One operating point: sequences x cached tokens each, query / kv heads, head dim, page size."""
    batch: int
    ctx: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 32

    @property
    def fp16_kv_bytes(self) -> int:
        """The fp16 K and V of all sequences: what the dense peers read."""
        return 2 * 2 * self.batch * self.kv_heads * self.ctx * self.head_dim

    @property
    def label(self) -> str:
        return f"{self.batch}x{self.ctx} {self.heads}/{self.kv_heads} d{self.head_dim} p{self.page_size}"


@dataclass(frozen=True)
class Run:
    """A point and the L2 modes it is timed in ("warm", "cold")."""
    point: Point
    modes: tuple[str, ...]


def grid(shapes, *, heads: int = 32, kv_heads=(8,), head_dims=(128,), page_sizes=(32,)) -> list[Point]:
    """Every combination of (batch, ctx) shapes, kv head counts, head dims and page sizes."""
    return [Point(batch, ctx, heads, kv, d, page)
            for (batch, ctx), kv, d, page in itertools.product(shapes, kv_heads, head_dims, page_sizes)]


def merge_runs(pairs) -> list[Run]:
    """(point, modes) pairs as one run per point (in first-seen order) with the union of its modes,
    warm before cold."""
    modes: dict[Point, set] = {}
    for point, wanted in pairs:
        modes.setdefault(point, set()).update(wanted)
    return [Run(point, tuple(m for m in L2_MODES if m in wanted)) for point, wanted in modes.items()]


def within_cap(runs, max_kv_bytes: int | None) -> tuple[list[Run], list[Run]]:
    """(kept, skipped): the runs whose fp16 K/V fit in max_kv_bytes (None: no cap)."""
    kept = [r for r in runs if max_kv_bytes is None or r.point.fp16_kv_bytes <= max_kv_bytes]
    return kept, [r for r in runs if r not in kept]


# The contract's grid, sized for about eight minutes on an H200 with the seven contract formats on
# all their QK paths: batch x context at GQA 32/8, D128, pages of 32, each L2-warm and HBM-cold; then
# GQA 1/4/8, every page size and D64 at one shape whose K/V is far larger than L2 (warm only).
PRESETS = {
    "contract": {"batches": (1, 8, 64, 256), "ctxs": (1024, 4096, 32768, 131072), "at": (8, 32768)},
    "smoke": {"batches": (1, 8), "ctxs": (1024, 4096), "at": (8, 4096)},
}


def preset_runs(name: str) -> list[Run]:
    """The runs of a preset (before any size cap)."""
    from ..formats.decode.recipes import PAGE_SIZES

    preset = PRESETS[name]
    main = grid(itertools.product(preset["batches"], preset["ctxs"]))
    at = Point(*preset["at"])
    side = ([replace(at, kv_heads=at.heads // ratio) for ratio in GQA_RATIOS]
            + [replace(at, page_size=page) for page in PAGE_SIZES] + [replace(at, head_dim=64)])
    return merge_runs([(p, L2_MODES) for p in main] + [(p, ("warm",)) for p in side])


def qk_variants(formats, paths, *, strict: bool) -> list[tuple[str, str]]:
    """(format, QK path) pairs to time: each format on each of `paths` it has ("auto" every format
    has). A path a format lacks is skipped, or with strict (one path asked for by name) an error."""
    from ..formats.decode.recipes import qk_paths

    pairs = []
    for fmt in formats:
        have = qk_paths(fmt)
        for path in paths:
            if path == "auto" or path in have:
                pairs.append((fmt, path))
            elif strict:
                raise ValueError(f"qk: {fmt} has no {path} path (its paths: {', '.join(have)})")
    if not pairs:
        raise ValueError(f"qk: none of {', '.join(formats)} has a {' or '.join(paths)} path")
    return pairs


def impl_name(fmt: str, qk: str, term: str = "plain") -> str:
    return (f"qattn:{fmt}" if qk == "auto" else f"qattn:{fmt}/{qk}") + ("" if term == "plain" else f" +{term}")


def with_k_terms(pairs, terms) -> list[tuple[str, str, str]]:
    """(format, QK path, K term) triples: each pair with each term its K takes (an 8-bit K every term,
    a 16-bit K "plain" only)."""
    from ..formats.decode.recipes import EIGHT_BIT

    return [(fmt, qk, term) for fmt, qk in pairs for term in terms
            if term == "plain" or fmt.split("-")[0] in EIGHT_BIT]


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy of nbytes (read + write counted), the ceiling of this GPU."""
    import cupy

    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    ms = time_cuda(lambda: cupy.copyto(dst, src), runs=20, min_ms=200.0).median_ms
    return 2 * nbytes / (ms * 1e-3) / 1e9


def kv_bytes(fmt: str, batch: int, kv_heads: int, ctx: int, head_dim: int, page_size: int, scale: str) -> int:
    """Bytes a decode step must read: K and V codes, token scales of 8-bit sides, the block table."""
    k, v = fmt.split("-")
    per_token = sum((1 if side in ("e4m3", "i8") else 2) * head_dim + (4 if side in ("e4m3", "i8") and
                                                                        scale == "token" else 0) for side in (k, v))
    return batch * kv_heads * ctx * per_token + batch * -(-ctx // page_size) * 4


# The K terms a decode can be timed with (`--k-term`; 8-bit K only beside "plain"): the cache options each
# sets. The bias is a fixed random one (20x the unit keys) that the keys written do not carry, so the terms
# with a bias are timed only (no rel_l2 against the SDPA peers).
K_TERMS = ("plain", "balance", "bias", "rope-post", "rope-pre")


def k_term_options(term: str, kv_heads: int, head_dim: int, ctx: int) -> dict:
    """PagedKVCache options of a K term."""
    from ..formats.decode import RoPE

    if term not in K_TERMS:
        raise ValueError(f"k_term: expected one of {', '.join(K_TERMS)}, got {term!r}")
    if term == "plain":
        return {}
    if term == "balance":
        return {"k_balance": "calibrate"}
    bias = np.random.default_rng(4).standard_normal((kv_heads, head_dim)).astype(np.float32) * 20
    if term == "bias":
        return {"k_bias": bias}
    return {"k_bias": bias, "rope": RoPE(max_positions=ctx), "k_bias_layout": term.replace("rope-", "") + "-rope"}


PAGE_ORDERS = ("shuffled", "in-order")


def page_ids(batch: int, ctx: int, page_size: int, order: str, rng) -> np.ndarray:
    """The block table [batch, pages a sequence] int32 of `batch` sequences of `ctx` tokens: a permutation
    of the pool's pages (as a serving engine's allocator leaves them after a while; rng draws it) or the
    pages in order (a fresh cache, each sequence's pages contiguous)."""
    if order not in PAGE_ORDERS:
        raise ValueError(f"page order: expected one of {', '.join(PAGE_ORDERS)}, got {order!r}")
    pages_per_seq = -(-ctx // page_size)
    ids = np.arange(batch * pages_per_seq) if order == "in-order" else rng.permutation(batch * pages_per_seq)
    return ids.reshape(batch, pages_per_seq).astype(np.int32)


def filled_cache(fmt, k, v, batch, ctx, kv_heads, head_dim, page_size, scale, table, **options):
    """A cache holding k, v [batch * ctx, kv_heads, head_dim] in the pages of table (numpy, page_ids;
    with the PagedKVCache options given; post-RoPE keys written at their index in the sequence);
    returns it and the table on the device."""
    import cupy

    from ..formats.decode import PagedKVCache

    num_pages = table.size
    k_side, v_side = fmt.split("-")
    cache = PagedKVCache(num_pages, page_size, kv_heads, head_dim, k=k_side, v=v_side, scale=scale, **options)
    tokens = np.arange(ctx)
    slots = (table[:, tokens // page_size] * page_size + tokens % page_size).reshape(-1).astype(np.int64)
    post_rope = options.get("rope") is not None and options.get("k_bias_layout") == "post-rope"
    positions = {"positions": cupy.asarray(np.tile(tokens, batch).astype(np.int64))} if post_rope else {}
    cache.write(k, v, cupy.asarray(slots), **positions)
    return cache, cupy.asarray(table)


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _peer_calls(point: Point, q, k, v, peers, base: dict, table):
    """The peers' (record, call) pairs, their error records, and the first SDPA peer's output (the
    fp16 reference), or None where none runs: the SDPA peers on dense fp16 copies of k, v; the
    paged peers on pages of k, v at qattn's page ids (table; their rel_l2 against the reference where
    there is one)."""
    import cupy

    fns = [(name, fn) for name in peers if name in SDPA_PEERS and (fn := peer(name)) is not None]
    timed, failed, reference = [], [], None
    if fns:
        import torch

        shape = (point.batch, point.ctx, point.kv_heads, point.head_dim)
        dense_k, dense_v = (torch.from_dlpack(x.reshape(shape).transpose(0, 2, 1, 3).copy()) for x in (k, v))
        tq = torch.from_dlpack(q)
    for name, fn in fns:
        call = functools.partial(fn, tq, dense_k, dense_v, False)
        try:
            result = call()
        except Exception as exc:  # backend unavailable for this shape/GPU
            failed.append(dict(base, impl=name, error=_first_line(exc)))
            continue
        reference = cupy.from_dlpack(result.contiguous()) if reference is None else reference
        timed.append((dict(base, impl=name, bytes=point.fp16_kv_bytes), call))
    for name in (n for n in peers if n in PAGED_PEERS):
        try:
            built = paged_peer(name, q, k, v, batch=point.batch, ctx=point.ctx, page_size=point.page_size, table=table)
            if built is None:  # FlashInfer is not installed
                continue
            call, nbytes = built
            result = cupy.from_dlpack(call().contiguous())
        except Exception as exc:  # the library cannot run this shape, head dim or page size here
            failed.append(dict(base, impl=name, error=_first_line(exc)))
            continue
        rec = dict(base, impl=name, bytes=nbytes)
        if reference is not None:
            rec["rel_l2_vs_fp16"] = _rel_l2(result.reshape(reference.shape), reference)
        timed.append((rec, call))
    return timed, failed, reference


def _rel_l2(out, reference) -> float:
    import cupy

    ref = reference.astype(cupy.float64)
    return float(cupy.linalg.norm(out.astype(cupy.float64) - ref) / cupy.linalg.norm(ref))


def fastest_peer_ratio(record: dict) -> float | None:
    """The faster SDPA backend's time over this record's (> 1: faster than both), or None. The faster
    backend has the smaller time, so the smaller of the vs_PEER ratios."""
    ratios = [record[f"vs_{p}"] for p in SDPA_PEERS if f"vs_{p}" in record]
    return min(ratios) if ratios else None


def bandwidth_fields(record: dict, copy_gbs: float) -> dict:
    """GB/s of the record's bytes at its median time, its fraction of the copy bandwidth, and the
    ratio to the faster SDPA backend."""
    gbs = record["bytes"] / (record["ms"] * 1e-3) / 1e9
    return {"gbs": gbs, "of_copy": gbs / copy_gbs, "vs_sdpa": fastest_peer_ratio(record)}


def mode_preludes(modes) -> dict:
    """What runs on the GPU ahead of each timed call, per L2 mode (GpuSpin, L2Flush): a spin that
    covers the host's time to enqueue the call (the events then time the GPU alone), after an L2
    eviction in the cold mode."""
    spin = GpuSpin()
    result = {"warm": spin}
    if "cold" in modes:
        flush = L2Flush()
        result["cold"] = lambda: (flush(), spin())
    return result


def _timer(prelude):
    """time_interleaved's timer (its default budget) with prelude() ahead of every timed call."""
    def timer(fn, rounds):
        return time_cuda_after(fn, prelude, runs=max(5, 20 // rounds), min_ms=200.0 / rounds).median_ms
    return timer


def _time_mode(timed, mode: str, rounds: int, prelude, copy_gbs: float) -> list[dict]:
    """One L2 mode's records of a point: every (record, call) timed in interleaved rounds."""
    runs = [(dict(rec, l2=mode), call) for rec, call in timed]
    per_round = time_interleaved([call for _, call in runs], rounds, _timer(prelude))
    records = with_ratios(runs, per_round, DECODE_PEERS)
    for rec in records:
        rec.update(bandwidth_fields(rec, copy_gbs))
    return records


def _bench_point(run: Run, variants, *, queries, scale, peers, rounds, splits, tile, stages, copy_gbs, preludes, rng,
                 crng, page_order):
    """The records of one point: peers and (format, QK path) variants on the same K/V in the same pages,
    in each mode."""
    import cupy

    from ..formats.decode import decode, launch_shape

    p = run.point
    base = {"batch": p.batch, "ctx": p.ctx, "heads": p.heads, "kv_heads": p.kv_heads, "head_dim": p.head_dim,
            "queries": queries, "page_size": p.page_size, "page_order": page_order, "scale": scale, "copy_gbs": copy_gbs}
    k, v = (crng.standard_normal((p.batch * p.ctx, p.kv_heads, p.head_dim), dtype=cupy.float32).astype(cupy.float16)
            for _ in range(2))
    q = crng.standard_normal((p.batch, p.heads, queries, p.head_dim), dtype=cupy.float32).astype(cupy.float16)
    lens = cupy.full(p.batch, p.ctx, dtype=cupy.int32)
    table = page_ids(p.batch, p.ctx, p.page_size, page_order, rng)
    timed, failed, reference = _peer_calls(p, q, k, v, peers, base, table) if queries == 1 else ([], [], None)
    caches = {}
    inputs = {"float16": (q, k, v)}  # a cache with a bf16 side takes bf16 K/V and Q: the same values rounded
    for fmt, qk, *rest in variants:
        term = rest[0] if rest else "plain"
        rec = dict(base, impl=impl_name(fmt, qk, term), format=fmt, qk=qk, k_term=term,
                   bytes=kv_bytes(fmt, p.batch, p.kv_heads, p.ctx, p.head_dim, p.page_size, scale))
        half = "bfloat16" if "bf16" in fmt.split("-") else "float16"
        if half not in inputs:
            inputs[half] = tuple(x.astype(half) for x in (q, k, v))
        fq, fk, fv = inputs[half]
        try:  # a path, option or spec this build or GPU lacks is recorded, not raised
            if (fmt, term) not in caches:
                caches[fmt, term] = filled_cache(fmt, fk, fv, p.batch, p.ctx, p.kv_heads, p.head_dim, p.page_size,
                                                 scale, table, **k_term_options(term, p.kv_heads, p.head_dim, p.ctx))
            cache, block_table = caches[fmt, term]
            own = tile
            if stages is not None:  # the variant's own default tile, with that many K/V slots
                own = replace(cache.spec(qk=qk, rows=p.heads // p.kv_heads * queries).tile, stages=stages)
            out = cupy.empty_like(fq)
            call = functools.partial(decode, fq, cache, block_table, lens, out=out, qk=qk, splits=splits, tile=own)
            call()
            rec.update(launch_shape(fq, cache, block_table, lens, qk=qk, splits=splits, tile=own))
        except (ValueError, TypeError, RuntimeError) as exc:
            failed.append(dict(rec, error=_first_line(exc)))
            continue
        if reference is not None and term in ("plain", "balance"):  # the K terms with a bias time unit keys
            rec["rel_l2_vs_fp16"] = _rel_l2(out, reference)
        timed.append((rec, call))
    del k, v, inputs  # the caches and the peers' dense copies hold them now
    records = failed
    for mode in run.modes:
        records += _time_mode(timed, mode, rounds, preludes[mode], copy_gbs)
    return records


def bench_sweep(runs, variants, *, queries: int = 1, scale: str = "token", peers=DECODE_PEERS, rounds: int = 3,
                seed: int = 0, splits=None, tiles=None, stages=None, page_order: str = "shuffled",
                progress=None) -> list[dict]:
    """One record per (run, L2 mode, implementation): median ms, GB/s, its fraction of the copy
    bandwidth, the ratio to each peer (vs_PEER) and to the faster one (vs_sdpa), rel_l2 against the
    fp16 SDPA answer on the same queries; a record with "error" where a peer or variant cannot run.
    runs: Run (point, modes); variants: (format, qk path) pairs or (format, qk path, K term) triples
    (K_TERMS); tiles: {head_dim: Tile} to override the formats' default tiles; stages: K/V slots in
    flight on each variant's default tile instead; page_order: each point's block table, "shuffled" or
    "in-order" (page_ids), the same for qattn and the paged peers; progress(run, records) after each run."""
    import cupy

    rng = np.random.default_rng(seed)
    crng = cupy.random.default_rng(seed)
    copy_gbs = copy_bandwidth()
    preludes = mode_preludes({mode for run in runs for mode in run.modes})
    records = []
    for run in runs:
        point_records = _bench_point(run, variants, queries=queries, scale=scale, peers=peers, rounds=rounds,
                                     splits=splits, tile=(tiles or {}).get(run.point.head_dim), stages=stages,
                                     copy_gbs=copy_gbs, preludes=preludes, rng=rng, crng=crng, page_order=page_order)
        records += point_records
        cupy.get_default_memory_pool().free_all_blocks()  # the next point's caches may differ in size
        if progress is not None:
            progress(run, point_records)
    return records


def bench_decode(shapes, formats=("f16-f16", "e4m3-e4m3", "i8-i8"), *, heads: int = 32, kv_heads: int = 8,
                 head_dim: int = 128, queries: int = 1, page_size: int = 32, scale: str = "token",
                 peers=DECODE_PEERS, rounds: int = 3, seed: int = 0, splits=None, tile=None) -> list[dict]:
    """bench_sweep over (batch, ctx) shapes at one head configuration, L2-warm, each format on its
    automatic QK path (records named qattn:FORMAT)."""
    runs = [Run(point, ("warm",)) for point in grid(shapes, heads=heads, kv_heads=(kv_heads,), head_dims=(head_dim,),
                                                    page_sizes=(page_size,))]
    return bench_sweep(runs, [(fmt, "auto") for fmt in formats], queries=queries, scale=scale, peers=peers,
                       rounds=rounds, seed=seed, splits=splits, tiles=None if tile is None else {head_dim: tile})


# ---- tables ------------------------------------------------------------------------------------

COLUMNS = ("B x L", "heads", "D", "page", "L2", "impl", "splits", "ms", "GB/s", "of copy", "vs SDPA", "vs FlashInfer",
           "rel_l2 vs fp16")
NUMERIC_COLUMNS = ("D", "page", "ms", "GB/s", "of copy", "vs SDPA", "vs FlashInfer", "rel_l2 vs fp16")


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def row_cells(record: dict) -> list[str]:
    """A record's cells under COLUMNS; an error record carries its message in the ms column."""
    head = [f"{record['batch']}x{record['ctx']}", f"{record['heads']}/{record['kv_heads']}", str(record["head_dim"]),
            str(record["page_size"]) + (" in order" if record.get("page_order") == "in-order" else ""),
            record.get("l2", "-"), record["impl"], _splits_cell(record)]
    if "error" in record:
        return head + [record["error"], "", "", "", "", ""]
    return head + [_cell(record["ms"], ".4f"), _cell(record["gbs"], ".0f"), _cell(record["of_copy"], ".2f"),
                   _cell(record.get("vs_sdpa"), ".2f"), _cell(flashinfer_ratio(record), ".2f"),
                   _cell(record.get("rel_l2_vs_fp16"), ".2e")]


def _splits_cell(record: dict) -> str:
    """A qattn record's split count and where its splits merge (a merge kernel, or in clusters)."""
    if "splits" not in record:
        return "-"
    return str(record["splits"]) + ("" if record.get("merge", "none") == "none" else f" ({record['merge']})")


def flashinfer_ratio(record: dict) -> float | None:
    """FlashInfer's time over this record's, against its cache of the same width: its e4m3 cache for a
    format 8-bit on both sides (K8/V8), its fp16 one otherwise; None where that peer did not run."""
    sides = str(record.get("format", "")).split("-")
    both_8bit = len(sides) == 2 and all(side in ("e4m3", "i8") for side in sides)
    return record.get("vs_flashinfer_e4m3" if both_8bit else "vs_flashinfer")


def markdown_table(records, *, date: str, gpu: str, command: str) -> str:
    """The records as a BENCHMARKS.md table under a line naming the date, GPU, copy bandwidth and
    command."""
    copy = next((r["copy_gbs"] for r in records), None)
    lines = [f"{date}, {gpu}, copy bandwidth {_cell(copy, '.0f')} GB/s, `{command}`", "",
             "| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---:" if c in NUMERIC_COLUMNS else "---" for c in COLUMNS) + "|"]
    for rec in records:
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row_cells(rec)) + " |")
    return "\n".join(lines) + "\n"


def gpu_name(device: int | None = None) -> str:
    import cupy

    with cupy.cuda.Device(device) as dev:
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def write_bytes(fmt: str, tokens: int, kv_heads: int, head_dim: int, page_size: int, scale: str) -> int:
    """Bytes the cache write of `tokens` new tokens moves: the fp16 K and V it reads, the codes and token
    scales it writes (kv_bytes without the block table, which it does not touch)."""
    return 2 * tokens * kv_heads * head_dim * 2 + kv_bytes(fmt, 1, kv_heads, tokens, head_dim, page_size, scale) \
        - -(-tokens // page_size) * 4


def decode_step_slots(pages: int, page_size: int, sequences: int, rng) -> np.ndarray:
    """The slots of one decode step's new tokens: one for each of `sequences` sequences, each on a page of
    its own (distinct pages of the pool, in random order) at a random offset in it."""
    if not 0 < sequences <= pages:
        raise ValueError(f"sequences: expected 1 to {pages} (one page each), got {sequences}")
    return rng.choice(pages, sequences, replace=False) * page_size + rng.integers(0, page_size, sequences)


def bench_write(tokens: int = 65536, formats=("e4m3-e4m3", "i8-i8", "f16-f16"), *, kv_heads: int = 8,
                head_dim: int = 128, page_size: int = 32, scale: str = "token", seed: int = 0,
                step_tokens=(8, 64, 256)) -> list[dict]:
    """The fused write of `tokens` new tokens against a plain copy of the same bytes (the fp16 K and V
    it reads and the codes and scales it writes), each timed alone. Two slot patterns per format: a
    prompt (pages shuffled, tokens in order within each page) and scattered single tokens (every token
    at a random slot of its own). Then the write of one decode step for each count in `step_tokens`: one
    new token for each of that many sequences, each on a page of its own, the write and its copy timed
    on the GPU alone (a spin covers the host's time to enqueue them: a captured CUDA graph's view)."""
    import cupy

    from ..formats.decode import PagedKVCache

    crng = cupy.random.default_rng(seed)
    rng = np.random.default_rng(seed)
    k, v = (crng.standard_normal((tokens, kv_heads, head_dim), dtype=cupy.float32).astype(cupy.float16)
            for _ in range(2))
    pages = -(-tokens // page_size)
    prompt = (rng.permutation(pages)[np.arange(tokens) // page_size] * page_size + np.arange(tokens) % page_size)
    patterns = {"prompt": prompt, "scattered": rng.permutation(tokens)}
    steps = {n: decode_step_slots(pages, page_size, n, rng) for n in step_tokens if n <= pages}
    spin = GpuSpin()
    records = []

    def moved_bytes(fmt: str, n: int) -> int:
        return write_bytes(fmt, n, kv_heads, head_dim, page_size, scale)

    def copy_ms(moved: int, timer) -> float:
        src = cupy.empty(moved // 2, dtype=cupy.uint8)
        dst = cupy.empty_like(src)
        return timer(lambda: cupy.copyto(dst, src)).median_ms

    for fmt in formats:
        k_side, v_side = fmt.split("-")
        cache = PagedKVCache(pages, page_size, kv_heads, head_dim, k=k_side, v=v_side, scale=scale)
        moved = moved_bytes(fmt, tokens)
        copy = copy_ms(moved, time_cuda)
        for name, slots in patterns.items():
            slots_d = cupy.asarray(slots.astype(np.int64))
            write_ms = time_cuda(lambda: cache.write(k, v, slots_d)).median_ms
            records.append({"format": fmt, "slots": name, "tokens": tokens, "kv_heads": kv_heads,
                            "head_dim": head_dim, "bytes": moved, "write_ms": write_ms, "copy_ms": copy,
                            "ratio": write_ms / copy})
        alone = functools.partial(time_cuda_after, before=spin)
        for n, slots in steps.items():
            slots_d = cupy.asarray(slots.astype(np.int64))
            kn, vn = k[:n], v[:n]
            moved_n = moved_bytes(fmt, n)
            write_ms = alone(lambda: cache.write(kn, vn, slots_d)).median_ms
            copy_n = copy_ms(moved_n, alone)
            records.append({"format": fmt, "slots": "decode step", "tokens": n, "kv_heads": kv_heads,
                            "head_dim": head_dim, "bytes": moved_n, "write_ms": write_ms, "copy_ms": copy_n,
                            "ratio": write_ms / copy_n})
    return records

"""`qattn bench`: prefill kernels beside their peers; `bench decode`, the paged decode's sweep; `bench paged-read`, a
plain reader of the cache's pages. qattn.cli adds the group to its own."""
from __future__ import annotations

import itertools
import re
import sys
import time
from pathlib import Path

import click

from .bench.peers import PEERS
from .cli_support import (HELP, _console, _fmt, _json_path, _note, _parse_decode_shapes, _Progress,
                          _split_kernel_entries, _table, user_errors, write_json)
from .engine import registry
from .engine.spec import device_arch
from .engine.tile import Tile


def _parse_bench_shapes(ctx, param, values):
    shapes = []
    for value in values:
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*/\s*(\d+)\s*", value)
        if not match or min(map(int, match.groups())) < 1:
            raise click.BadParameter(f"expected BATCH/HEADS/SEQ with positive integers, e.g. 4/32/4096, got {value!r}")
        shapes.append(tuple(map(int, match.groups())))
    return shapes


@click.group(invoke_without_command=True, context_settings=HELP)
@click.pass_context
@click.option("--format", "-f", "formats", multiple=True, callback=_split_kernel_entries, metavar="FORMAT[,FORMAT...]",
              help="qattn formats to time, each as FORMAT[@UNIT][+OPTION[=VALUE]...][:TILE] for the format on a "
                   "matrix unit, with template options or on a tile (e.g. f16@wgmma+persistent, "
                   "i8-f16+pingpong=off:m128n64w8s3); repeatable, comma lists allowed [default: f16]")
@click.option("--shape", "shapes", multiple=True, callback=_parse_bench_shapes, metavar="BATCH/HEADS/SEQ",
              help="Lq = Lk = SEQ; repeatable [default: 4/32/4096 and 1/32/32768]")
@click.option("--head-dim", "-d", type=click.IntRange(min=1), default=128, show_default=True, help="head dimension D")
@click.option("--causal/--no-causal", default=False, show_default=True, help="bottom-right aligned causal mask")
@click.option("--peer", "peers", multiple=True, type=click.Choice(PEERS),
              help="peers to time beside qattn: torch SDPA flash or cuDNN, SageAttention's sageattn (1.0.6) or "
                   "SageAttention2's (sageattn2: the package sageattention2, or sageattention when it is v2); repeatable "
                   "[default: all whose library is importable]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              callback=_json_path, help="also write the records as JSON to FILE")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the random inputs")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="interleaved timing rounds per shape (every implementation once a round, odd rounds in reverse; the median is kept)")
@click.option("--sustained", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="time each implementation over SECONDS of back-to-back calls per round (the power-capped "
                   "steady state) instead of single calls")
@click.option("--settle", type=click.FloatRange(min=0), default=0.3, show_default=True, metavar="SECONDS",
              help="idle the GPU this long before each implementation's timing, so that none is timed in the "
                   "wake of a power-hungry one (with 0, the entry listed right after the peers follows them in "
                   "every other round and reads several percent slow)")
@user_errors
def bench(ctx, formats, shapes, head_dim, causal, peers, json_path, seed, rounds, sustained, settle):
    """Time qattn prefill kernels and their peers (torch SDPA flash and cuDNN, SageAttention) on the
    same inputs in the same run; rel_l2 is each one's error against FP64 on the first heads.
    `qattn bench decode` times the paged decode instead (its own options)."""
    if ctx.invoked_subcommand is not None:
        return
    from .bench import prefill as timing

    if device_arch() is None:
        raise click.ClickException("bench: no CUDA GPU found; timing needs one")
    records = timing.bench_prefill(shapes or [(4, 32, 4096), (1, 32, 32768)], formats or ("f16",), head_dim=head_dim,
                                   causal=causal, peers=peers or PEERS, seed=seed, rounds=rounds,
                                   sustained=sustained, settle=settle)
    ratios = sorted({k for r in records for k in r if k.startswith("vs_")})
    table = _table(f"prefill, D {head_dim}, {'causal' if causal else 'non-causal'}", "batch/heads/seq", "impl", "ms",
                   "TFLOPS", "rel_l2", *ratios, right=("ms", "TFLOPS", "rel_l2", *ratios))
    for r in records:
        cells = [_fmt(r.get(k), ".2f") for k in ratios]
        table.add_row(f"{r['batch']}/{r['heads']}/{r['seq']}", r["impl"], _fmt(r.get("ms"), ".3f"),
                      _fmt(r.get("tflops"), ".1f") if "error" not in r else r["error"], _fmt(r.get("rel_l2"), ".2e"),
                      *cells)
    _console().print(table)
    if json_path is not None:
        write_json(json_path, records)


_SIZE = re.compile(r"\s*(\d+)\s*([kKmM]?)\s*")


def _parse_sizes(ctx, param, values):
    """Repeatable comma lists of positive sizes; K and M mean 1024 and 1024² (32K = 32768)."""
    sizes = []
    for value in values:
        for item in value.split(","):
            match = _SIZE.fullmatch(item)
            if not match or int(match.group(1)) < 1:
                raise click.BadParameter(f"expected positive sizes such as 8, 4096 or 32K, got {item!r}")
            sizes.append(int(match.group(1)) << {"": 0, "k": 10, "m": 20}[match.group(2).lower()])
    return list(dict.fromkeys(sizes))


def _decode_shapes(shapes, batches, ctxs) -> list[tuple[int, int]]:
    """--shape pairs, then every --batch at every --ctx; the default shapes when none is given."""
    if bool(batches) != bool(ctxs):
        raise click.BadParameter("--batch and --ctx go together (every batch at every context)",
                                 param_hint="'--batch' / '--ctx'")
    from .bench.decode import DEFAULT_SHAPES

    return list(dict.fromkeys([*shapes, *itertools.product(batches, ctxs)])) or list(DEFAULT_SHAPES)


def _kv_head_counts(heads: int, kv_heads, gqa) -> list[int]:
    """--kv-heads and heads / --gqa ratio for each ratio; 8 when neither is given."""
    counts = list(kv_heads)
    for ratio in gqa:
        if heads % ratio:
            raise click.BadParameter(f"{ratio} does not divide --heads {heads}", param_hint="'--gqa'")
        counts.append(heads // ratio)
    for kv in counts:
        if heads % kv:
            raise click.BadParameter(f"{heads} is not a multiple of --kv-heads {kv}", param_hint="'--heads'")
    return list(dict.fromkeys(counts)) or [8]


def _decode_runs(preset, shapes, batches, ctxs, heads, kv_heads, gqa, head_dims, page_sizes, cold):
    """The runs of a bench decode call: a preset's, or the grid of the shape options in one L2 mode."""
    from .bench import decode as timing

    if preset:
        given = [name for name, value in (("--shape", shapes), ("--batch", batches), ("--ctx", ctxs),
                                          ("--heads", heads), ("--kv-heads", kv_heads), ("--gqa", gqa),
                                          ("--head-dim", head_dims), ("--page-size", page_sizes), ("--cold", cold))
                 if value]
        if given:
            raise click.BadParameter(f"the preset sets the grid and the L2 modes; leave out {', '.join(given)}",
                                     param_hint="'--preset'")
        return timing.preset_runs(preset)
    heads = heads or 32
    points = timing.grid(_decode_shapes(shapes, batches, ctxs), heads=heads,
                         kv_heads=_kv_head_counts(heads, kv_heads, gqa),
                         head_dims=[int(d) for d in head_dims] or [128],
                         page_sizes=[int(p) for p in page_sizes] or [32])
    return [timing.Run(point, ("cold",) if cold else ("warm",)) for point in points]


def _decode_variants(preset, formats, qk_paths):
    """(format, QK path) pairs: every requested path on the formats that have it; one path named
    for formats named is checked on each of them."""
    from .bench import decode as timing

    default_formats = timing.contract_formats() if preset else timing.DEFAULT_FORMATS
    default_paths = ("transform", "fp8", "int8") if preset else ("auto",)
    strict = bool(formats) and len(qk_paths) == 1 and qk_paths[0] != "auto"
    try:
        return timing.qk_variants(formats or default_formats, qk_paths or default_paths, strict=strict)
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("qk: "), param_hint="'--qk'") from None


def _parse_tile_name(ctx, param, value):
    """--tile NAME -> Tile (None when not given)."""
    if value is None:
        return None
    try:
        return Tile.from_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("tile: "), ctx=ctx, param=param) from None


def _command_line() -> str:
    """This command as typed (the program name as click knows it), for the markdown header."""
    import shlex

    return " ".join([click.get_current_context().find_root().info_name, *map(shlex.quote, sys.argv[1:])])


@bench.command("decode")
@click.option("--shape", "shapes", multiple=True, callback=_parse_decode_shapes, metavar="BATCHxCTX",
              help="sequences x cached tokens each; repeatable [default: 8x32768, 64x4096, 1x131072]")
@click.option("--batch", "batches", multiple=True, callback=_parse_sizes, metavar="N[,N...]",
              help="sequences, timed at every --ctx; repeatable, comma lists allowed")
@click.option("--ctx", "ctxs", multiple=True, callback=_parse_sizes, metavar="L[,L...]",
              help="cached tokens per sequence, e.g. 1K,4K,32K,128K; repeatable, comma lists allowed")
@click.option("--preset", type=click.Choice(["smoke", "contract"]),
              help="a grid with its L2 modes: contract (batch 1-256 x context 1K-128K warm and cold, GQA 1/4/8, "
                   "every page size and D64 at 8x32768; the K16/V16, K8/V16, K16/V8, K8/V8 formats of e4m3 and i8 on "
                   "every QK path) or smoke (the same, small)")
@click.option("--format", "-f", "formats", multiple=True, type=click.Choice(list(registry.recipes("decode"))),
              help="decode format K-V; repeatable [default: f16-f16, e4m3-e4m3, i8-i8, e4m3-f16, f16-e4m3; the "
                   "contract's seven with --preset]")
@click.option("--qk", "qk_paths", multiple=True, type=click.Choice(["auto", "transform", "fp8", "int8"]),
              help="QK paths to time each format on (those it has; one path named for formats named must be theirs); "
                   "repeatable [default: auto; every path with --preset]")
@click.option("--k-term", "k_terms", multiple=True, type=click.Choice(["plain", "balance", "bias", "rope-post", "rope-pre"]),
              help="what an 8-bit K cache carries beside its codes: nothing, Q/K channel balancing, a pre-bias residual "
                   "K, or one under RoPE (post- or pre-RoPE keys); repeatable [default: plain]")
@click.option("--heads", type=click.IntRange(min=1), help="query heads [default: 32]")
@click.option("--kv-heads", "kv_heads", multiple=True, type=click.IntRange(min=1),
              help="kv heads; repeatable [default: 8]")
@click.option("--gqa", multiple=True, type=click.IntRange(min=1),
              help="query heads per kv head (kv heads = heads / GQA), beside --kv-heads; repeatable")
@click.option("--head-dim", "-d", "head_dims", multiple=True, type=click.Choice(["64", "128"]),
              help="head dimension; repeatable [default: 128]")
@click.option("--page-size", "page_sizes", multiple=True, type=click.Choice(["16", "32", "64", "128"]),
              help="tokens per page; repeatable [default: 32]")
@click.option("--queries", type=click.IntRange(1, 16), default=1, show_default=True,
              help="new tokens per sequence (the peers run only for 1)")
@click.option("--scale", type=click.Choice(("token", "head")), default="token", show_default=True,
              help="scales of the 8-bit sides")
@click.option("--cold", is_flag=True,
              help="HBM-cold timing: L2 evicted (a read of 4x its size) before every timed call [default: L2-warm]")
@click.option("--max-kv-gib", type=click.FloatRange(min=0, min_open=True), default=8.0, show_default=True,
              help="skip points whose fp16 K and V exceed this (every format's cache of a point lives at once)")
@click.option("--splits", type=click.IntRange(1, 128), help="split count [default: chosen per shape]")
@click.option("--page-order", type=click.Choice(("shuffled", "in-order")), default="shuffled", show_default=True,
              help="the block table: the pool's pages shuffled (as an engine's allocator leaves them) or each "
                   "sequence's pages in order (a fresh cache); qattn and the paged peers read the same pages")
@click.option("--stages", type=click.IntRange(2, 4), help="K/V slots in flight [default: the format's tile]")
@click.option("--tile", callback=_parse_tile_name, metavar="NAME",
              help="run every variant on this tile, e.g. m8n32w2s3 (block_m 8, 16 keys a warp, 2-4 slots) "
                   "[default: each format's own]")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="interleaved timing rounds")
@click.option("--write-tokens", type=click.IntRange(min=0), default=65536, show_default=True,
              help="tokens of the cache-write timing, as a prompt and as scattered single tokens, then decode "
                   "steps of 8, 64 and 256 sequences timed on the GPU alone (0: skip it)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              callback=_json_path, help="also write the records as JSON to FILE")
@click.option("--markdown", is_flag=True, help="also print the table as markdown for BENCHMARKS.md")
@user_errors
def bench_decode(shapes, batches, ctxs, preset, formats, qk_paths, k_terms, heads, kv_heads, gqa, head_dims, page_sizes,
                 queries, scale, cold, max_kv_gib, splits, page_order, stages, tile, rounds, write_tokens, json_path,
                 markdown):
    """Time the paged decode in each cache format and QK path beside torch SDPA (flash, cuDNN) on the
    same queries over the same K/V in fp16 and, where it is installed, FlashInfer's paged decode over
    the same pages (fp16, and e4m3 with one scale per tensor), L2-warm or HBM-cold, and the one-launch
    cache write beside a copy of the same bytes; GB/s of the bytes a step must read, as a fraction of
    the copy bandwidth measured in the same run, the ratio to the faster SDPA backend and to FlashInfer
    (its e4m3 cache for K8/V8 formats)."""
    from .bench import decode as timing

    if tile is not None and stages is not None:
        raise click.BadParameter("give --tile or --stages, not both (a tile names its slots)", param_hint="'--tile'")
    runs = _decode_runs(preset, shapes, batches, ctxs, heads, kv_heads, gqa, head_dims, page_sizes, cold)
    variants = timing.with_k_terms(_decode_variants(preset, formats, qk_paths), k_terms or ("plain",))
    if not variants:
        raise click.BadParameter("only an 8-bit K carries a K term: add a format with an e4m3 or i8 K, or 'plain'",
                                 param_hint="'--k-term'")
    if device_arch() is None:
        raise click.ClickException("bench decode: no CUDA GPU found; timing needs one")
    runs, skipped = timing.within_cap(runs, int(max_kv_gib * (1 << 30)))
    if skipped:
        _note(f"skipped over --max-kv-gib {max_kv_gib:g}: {', '.join(r.point.label for r in skipped)}")
    if not runs:
        raise click.BadParameter(f"every point's fp16 K/V exceeds {max_kv_gib:g} GiB", param_hint="'--max-kv-gib'")
    with _Progress("bench decode", len(runs)) as progress:
        records = timing.bench_sweep(runs, variants, queries=queries, scale=scale, rounds=rounds, splits=splits,
                                     stages=stages, page_order=page_order,
                                     tiles=None if tile is None else {run.point.head_dim: tile for run in runs},
                                     progress=lambda run, recs: progress.done(
                                         f"{run.point.label} {'+'.join(run.modes)}: {len(recs)} records"))
    first = runs[0].point
    writes = timing.bench_write(write_tokens, kv_heads=first.kv_heads, head_dim=first.head_dim,
                                page_size=first.page_size, scale=scale) if write_tokens else []
    meta = {"date": time.strftime("%Y-%m-%d"), "gpu": timing.gpu_name(), "command": _command_line()}
    copy = records[0]["copy_gbs"] if records else float("nan")
    table = _table(f"decode, {queries} new token(s) per sequence, {scale} scales, copy {copy:.0f} GB/s",
                   *timing.COLUMNS, right=timing.NUMERIC_COLUMNS)
    for r in records:
        table.add_row(*timing.row_cells(r))
    console = _console()
    console.print(table)
    if writes:
        wtable = _table("cache write", "format", "slots", "tokens", "write ms", "copy ms", "ratio",
                        right=("tokens", "write ms", "copy ms", "ratio"))
        for w in writes:
            wtable.add_row(w["format"], w["slots"], str(w["tokens"]), _fmt(w["write_ms"], ".4f"),
                           _fmt(w["copy_ms"], ".4f"), _fmt(w["ratio"], ".2f"))
        console.print(wtable)
    if markdown:
        click.echo(timing.markdown_table(records, **meta))
    if json_path is not None:
        write_json(json_path, {"meta": meta, "decode": records, "write": writes})


@bench.command("paged-read")
@click.option("--format", "-f", "formats", multiple=True, type=click.Choice(list(registry.recipes("decode"))),
              help="cache format K-V (its K and V piece sizes); repeatable [default: e4m3-e4m3, f16-f16]")
@click.option("--page-size", "page_sizes", multiple=True, type=click.Choice(["16", "32", "64", "128"]),
              help="tokens per page; repeatable [default: 16, 32, 64, 128]")
@click.option("--head-dim", "-d", "head_dims", multiple=True, type=click.Choice(["64", "128"]),
              help="head dimension; repeatable [default: 128]")
@click.option("--kv-heads", type=click.IntRange(min=1), default=8, show_default=True,
              help="kv heads (the blocks streaming one page side by side)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, path_type=Path),
              callback=_json_path, help="also write the records as JSON to FILE")
@user_errors
def bench_paged_read(formats, page_sizes, head_dims, kv_heads, json_path):
    """What a plain reader of a paged cache attains on this GPU: a kernel that only streams the pools'
    pages, in the decode kernel's pattern and piece sizes, at several depths of its copy ring; GB/s of
    the fastest depth and of each, as a fraction of the copy bandwidth measured in the same run (the
    reference for `qattn bench decode`'s "of copy": a decode well below it is bound by its own work)."""
    from .bench import paged_read as reader

    if device_arch() is None:
        raise click.ClickException("bench paged-read: no CUDA GPU found; timing needs one")
    points = list(itertools.product(formats or ("e4m3-e4m3", "f16-f16"), map(int, page_sizes or (16, 32, 64, 128)),
                                    map(int, head_dims or (128,))))
    table = _table(f"paged read: a reader that only streams the pages, {kv_heads} kv heads", "format", "page", "D", "pieces", "GB/s",
                   "of copy", "slots x blocks/SM", "each depth (of copy)",
                   right=("page", "D", "GB/s", "of copy"))
    records = []
    with _Progress("bench paged-read", len(points)) as progress:
        for fmt, page, d in points:
            found = reader.paged_read(fmt, page, d, kv_heads=kv_heads)
            best = reader.fastest(found)
            table.add_row(fmt, str(page), str(d), f"{best['k_piece']} + {best['v_piece']} B", f"{best['gbs']:.0f}",
                          f"{best['of_copy']:.3f}", f"{best['stages']} x {best['blocks_per_sm']}",
                          "  ".join(f"{r['stages']}x{r['blocks_per_sm']} {r['of_copy']:.2f}" for r in found))
            records += found
            progress.done(f"{fmt} pages of {page}, D{d}: {best['of_copy']:.3f} of copy")
    _console().print(table)
    if json_path is not None:
        write_json(json_path, {"meta": {"date": time.strftime("%Y-%m-%d"), "command": _command_line()},
                               "paged_read": records})

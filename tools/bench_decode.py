#!/usr/bin/env python3
"""Time qattn's paged decode in each cache format beside torch SDPA (flash, cuDNN) on the same queries
over the same K/V in fp16, and the fused cache write beside a plain copy of the same bytes; GB/s of the
bytes that must cross HBM, and the fraction of this GPU's copy bandwidth (measured in the same run).

    tools/bench_decode.py --shape 8x32768 --shape 64x4096 --shape 1x131072 --json decode.json
    tools/bench_decode.py --format e4m3-e4m3 --page-size 16 --kv-heads 8 --heads 64 --shape 16x8192
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.bench.decode import bench_decode, bench_write  # noqa: E402
from qattn.engine.tile import Tile  # noqa: E402


def _shape(text: str) -> tuple[int, int]:
    try:
        batch, ctx = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxCTX such as 8x32768, got {text!r}") from None
    if batch < 1 or ctx < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return batch, ctx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=_shape, action="append", help="BATCHxCTX (repeatable)")
    ap.add_argument("--format", action="append", dest="formats", help="decode format K-V (repeatable)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=1, help="new tokens per sequence (peers run only for 1)")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--scale", choices=("token", "head"), default="token")
    ap.add_argument("--splits", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None, help="K/V slots in flight (default: the format's tile)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write-tokens", type=int, default=65536, help="tokens of the write benchmark (0: skip)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    records = bench_decode(args.shape or [(8, 32768), (64, 4096), (1, 131072)],
                           args.formats or ("f16-f16", "e4m3-e4m3", "i8-i8", "e4m3-f16", "f16-e4m3"),
                           heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, queries=args.queries,
                           page_size=args.page_size, scale=args.scale, rounds=args.rounds, splits=args.splits,
                           tile=None if args.stages is None else Tile(8, 64, 4, args.stages))
    writes = bench_write(args.write_tokens, kv_heads=args.kv_heads, head_dim=args.head_dim,
                         page_size=args.page_size, scale=args.scale) if args.write_tokens else []
    print(f"copy bandwidth {records[0]['copy_gbs']:.0f} GB/s" if records else "no records")
    peers = sorted({k for r in records for k in r if k.startswith("vs_")})
    print(f"{'batch x ctx':>12} {'impl':>18} {'ms':>8} {'GB/s':>7} {'of copy':>7} " + " ".join(f"{p:>14}" for p in peers)
          + f" {'rel_l2 vs fp16':>14}")
    for r in records:
        if "error" in r:
            print(f"{r['batch']:>5}x{r['ctx']:<6} {r['impl']:>18} {r['error']}")
            continue
        cells = " ".join(f"{r[p]:>14.2f}" if p in r else f"{'':>14}" for p in peers)
        err = f"{r['rel_l2_vs_fp16']:>14.2e}" if "rel_l2_vs_fp16" in r else ""
        print(f"{r['batch']:>5}x{r['ctx']:<6} {r['impl']:>18} {r['ms']:>8.4f} {r['gbs']:>7.0f} {r['of_copy']:>7.2f} "
              f"{cells} {err}")
    for w in writes:
        print(f"write {w['format']:>10} {w['slots']:>6} {w['tokens']} tokens: {w['write_ms']:.4f} ms, copy of the same bytes "
              f"{w['copy_ms']:.4f} ms ({w['ratio']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"decode": records, "write": writes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

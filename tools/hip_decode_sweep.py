#!/usr/bin/env python3
"""Compile every HIP decode spec of the chosen QK paths offline (clang-19, no ROCm) and check each
module: each attention entry's (one per query type, fp16 or bf16) QK product on the path's matrix op
(the query type's 16-bit op for transform, fp8 or int8 for the 8-bit paths) and PV on the query type's
16-bit op, no scratch and no VGPR spills in any entry (attention, merge, the four writers). Prints one row
per (format, path, arch, head dim, query type) with the worst VGPR counts over its page sizes and scale
modes; exits 1 if any spec fails. tests/test_hip_decode.py compiles a subset.

    python tools/hip_decode_sweep.py                  # the 8-bit QK paths
    python tools/hip_decode_sweep.py --qk transform --qk fp8 --qk int8
"""
import argparse
import itertools
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qattn.engine.compile import compile_hip_offline, disassemble, functions_by_symbol, resource_remarks  # noqa: E402
from qattn.engine.family import HIP_ARCHS  # noqa: E402
from qattn.engine.inspect import HIP_MATRIX_OPS  # noqa: E402
from qattn.engine.render import entry_name, render  # noqa: E402
from qattn.engine.spec import KernelSpec  # noqa: E402
from qattn.formats.decode.recipes import (FORMATS, HEAD_DIMS, HIP_QK_ARCHS, PAGE_SIZES, SCALE_MODES,  # noqa: E402
                                          hip_family)

WRITERS = [f"_write_{t}_{s}" for t in ("f16", "bf16") for s in ("i32", "i64")]


def specs(paths):
    for fmt in FORMATS:
        fam = hip_family(fmt)
        for qk in paths:
            if qk not in fam.options.get("qk", ("transform",)):  # a 16-bit K: transform alone
                continue
            for arch in HIP_ARCHS if qk == "transform" else HIP_QK_ARCHS[qk]:
                for d, page, scale in itertools.product(HEAD_DIMS, PAGE_SIZES, SCALE_MODES):
                    options = {"page_size": page, "scale_mode": scale, **({"qk": qk} if "qk" in fam.options else {})}
                    yield qk, KernelSpec(kind="decode", recipe=fmt, head_dim=d, backend="hip", arch=arch, options=options)


def check(item):
    """One spec's rows (one per query type: its attention entry's QK and 16-bit op counts, VGPRs, SGPR
    spills, the writers' VGPRs) and its problems."""
    qk, spec = item
    binary = compile_hip_offline(render(spec), spec.arch, spec.name)
    funcs = functions_by_symbol(disassemble(binary.data, "hip"))
    res = resource_remarks(binary.log)
    name, problems, rows = entry_name(spec), [], []
    waves, nt, dt = (2 if spec.arch.startswith("gfx9") else 1), spec.tile.block_n // 16, spec.head_dim // 16
    pv = waves * nt * dt
    writer_vgprs = max(res.get(name + e, {}).get("VGPRs", 0) for e in WRITERS)
    types = hip_family(spec.recipe).values["query_types"]
    for t in types:
        main = funcs.get(name + "_" + t, "")
        qk_ops = len(re.findall(rf"\b{HIP_MATRIX_OPS[t if qk == 'transform' else qk, spec.arch]}\b", main))
        half_ops = len(re.findall(rf"\b{HIP_MATRIX_OPS[t, spec.arch]}\b", main))
        if qk != "transform" and (qk_ops == 0 or half_ops != pv):
            problems.append(f"_{t}: {qk} ops {qk_ops}, {t} ops {half_ops} (PV {pv})")
        if qk == "transform" and half_ops < pv + waves * nt:
            problems.append(f"_{t}: {t} ops {half_ops} (PV {pv} and S)")
        r = res.get(name + "_" + t, {})
        rows.append((t, qk_ops, half_ops, r.get("VGPRs", 0), r.get("SGPRs Spill", 0), writer_vgprs))
    for entry in [s for t in types for s in (f"_{t}", f"_merge_{t}")] + WRITERS:
        r = res.get(name + entry)
        if r is None:
            problems.append(f"no {entry}")
        elif r["ScratchSize"] or r["VGPRs Spill"]:
            problems.append(f"{entry} scratch {r['ScratchSize']} VGPR spills {r['VGPRs Spill']}")
    return qk, spec, rows, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qk", action="append", choices=("transform", "fp8", "int8"),
                    help="QK paths to sweep (default: fp8 and int8)")
    ap.add_argument("--jobs", type=int, default=4, help="compiles at a time")
    args = ap.parse_args()
    items = list(specs(args.qk or ["fp8", "int8"]))
    rows, failed = {}, 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for qk, spec, spec_rows, problems in pool.map(check, items):
            if problems:
                failed += 1
                print(f"FAIL {spec.name}: {'; '.join(problems)}")
            for t, qk_ops, half_ops, vgprs, sgpr_spills, writer in spec_rows:
                key = (spec.recipe, qk, spec.arch, spec.head_dim, t)
                old = rows.get(key, (0, 0, 0, 0, 0, 0))
                rows[key] = (old[0] + 1, qk_ops, half_ops, max(old[3], vgprs), max(old[4], sgpr_spills),
                             max(old[5], writer))
    print(f"{'format':10} {'qk':9} {'arch':8} {'d':>4} {'q':4} {'specs':>5} {'QK ops':>6} {'16-bit ops':>10} "
          f"{'VGPRs':>5} {'SGPR spills':>11} {'writer VGPRs':>12}")
    for (fmt, qk, arch, d, t), (n, qk_ops, half_ops, vgprs, sgpr, writer) in sorted(rows.items()):
        print(f"{fmt:10} {qk:9} {arch:8} {d:4} {t:4} {n:5} {qk_ops:6} {half_ops:10} {vgprs:5} {sgpr:11} {writer:12}")
    # SGPR spills go to VGPR lanes (v_writelane), not to scratch
    print(f"{len(items)} specs, {failed} failed; no scratch or VGPR spills in the others")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

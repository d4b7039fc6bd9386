#!/usr/bin/env python3
"""Compile every HIP decode spec of the chosen QK paths offline (clang-19, no ROCm) and check each
module: the attention entry's QK product on the path's matrix op (fp16 for transform, fp8 or int8
for the 8-bit paths) and PV on the fp16 op, no scratch and no VGPR spills in any entry (attention,
merge, the four writers). Prints one row per (format, path, arch, head dim) with the worst VGPR counts over
its page sizes and scale modes; exits 1 if any spec fails. tests/test_hip_decode.py compiles a subset.

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
from qattn.engine.render import entry_name, render  # noqa: E402
from qattn.engine.spec import KernelSpec  # noqa: E402
from qattn.formats.decode.recipes import (FORMATS, HEAD_DIMS, HIP_QK_ARCHS, PAGE_SIZES, SCALE_MODES,  # noqa: E402
                                          hip_family)

OPS = {("transform", "gfx90a"): "v_mfma_f32_16x16x16f16", ("transform", "gfx942"): "v_mfma_f32_16x16x16_f16",
       ("transform", "gfx1100"): "v_wmma_f32_16x16x16_f16", ("transform", "gfx1201"): "v_wmma_f32_16x16x16_f16",
       ("fp8", "gfx942"): "v_mfma_f32_16x16x32_fp8_fp8", ("fp8", "gfx1201"): "v_wmma_f32_16x16x16_fp8_fp8",
       ("int8", "gfx90a"): "v_mfma_i32_16x16x16i8", ("int8", "gfx942"): "v_mfma_i32_16x16x32_i8",
       ("int8", "gfx1100"): "v_wmma_i32_16x16x16_iu8", ("int8", "gfx1201"): "v_wmma_i32_16x16x16_iu8"}
ENTRIES = ["_f16", "_merge_f16"] + [f"_write_{t}_{s}" for t in ("f16", "bf16") for s in ("i32", "i64")]


def specs(paths):
    for fmt in FORMATS:
        fam = hip_family(fmt)
        if fam is None:
            continue
        for qk in paths:
            if qk not in fam.options.get("qk", ("transform",)):  # a 16-bit K: transform alone
                continue
            for arch in HIP_ARCHS if qk == "transform" else HIP_QK_ARCHS[qk]:
                for d, page, scale in itertools.product(HEAD_DIMS, PAGE_SIZES, SCALE_MODES):
                    options = {"page_size": page, "scale_mode": scale, **({"qk": qk} if "qk" in fam.options else {})}
                    yield qk, KernelSpec(kind="decode", recipe=fmt, head_dim=d, backend="hip", arch=arch, options=options)


def check(item):
    qk, spec = item
    binary = compile_hip_offline(render(spec), spec.arch, spec.name)
    asm = disassemble(binary.data, "hip")
    funcs = functions_by_symbol(asm)
    name, problems = entry_name(spec), []
    main = funcs.get(name + "_f16", "")
    qk_ops = len(re.findall(rf"\b{OPS[qk, spec.arch]}\b", main))
    f16_ops = len(re.findall(rf"\b{OPS['transform', spec.arch]}\b", main))
    waves, nt, dt = (2 if spec.arch.startswith("gfx9") else 1), spec.tile.block_n // 16, spec.head_dim // 16
    pv = waves * nt * dt
    if qk != "transform" and (qk_ops == 0 or f16_ops != pv):
        problems.append(f"{qk} ops {qk_ops}, fp16 ops {f16_ops} (PV {pv})")
    res = resource_remarks(binary.log)
    for entry in ENTRIES:
        r = res.get(name + entry)
        if r is None:
            problems.append(f"no {entry}")
        elif r["ScratchSize"] or r["VGPRs Spill"]:
            problems.append(f"{entry} scratch {r['ScratchSize']} VGPR spills {r['VGPRs Spill']}")
    main_res = res.get(name + "_f16", {})
    writer_vgprs = max(res.get(name + e, {}).get("VGPRs", 0) for e in ENTRIES[2:])
    return (qk, spec, qk_ops, f16_ops, main_res.get("VGPRs", 0), main_res.get("SGPRs Spill", 0), writer_vgprs,
            problems)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qk", action="append", choices=("transform", "fp8", "int8"),
                    help="QK paths to sweep (default: fp8 and int8)")
    ap.add_argument("--jobs", type=int, default=4, help="compiles at a time")
    args = ap.parse_args()
    items = list(specs(args.qk or ["fp8", "int8"]))
    rows, failed = {}, 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for qk, spec, qk_ops, f16_ops, vgprs, sgpr_spills, writer, problems in pool.map(check, items):
            if problems:
                failed += 1
                print(f"FAIL {spec.name}: {'; '.join(problems)}")
            key = (spec.recipe, qk, spec.arch, spec.head_dim)
            old = rows.get(key, (0, 0, 0, 0, 0, 0))
            rows[key] = (old[0] + 1, qk_ops, f16_ops, max(old[3], vgprs), max(old[4], sgpr_spills), max(old[5], writer))
    print(f"{'format':10} {'qk':9} {'arch':8} {'d':>4} {'specs':>5} {'QK ops':>6} {'fp16 ops':>8} "
          f"{'VGPRs':>5} {'SGPR spills':>11} {'writer VGPRs':>12}")
    for (fmt, qk, arch, d), (n, qk_ops, f16_ops, vgprs, sgpr, writer) in sorted(rows.items()):
        print(f"{fmt:10} {qk:9} {arch:8} {d:4} {n:5} {qk_ops:6} {f16_ops:8} {vgprs:5} {sgpr:11} {writer:12}")
    # SGPR spills go to VGPR lanes (v_writelane), not to scratch
    print(f"{len(items)} specs, {failed} failed; no scratch or VGPR spills in the others")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""qattn.bench.sass_profile and tools/ncu_sass.py on source-page exports written here (no GPU, no ncu)."""
import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from qattn.bench import sass_profile

ROOT = Path(__file__).resolve().parent.parent
REASONS = ("barrier", "long_sb", "wait", "selected")
HEADER = ["Address", "Source", sass_profile.SAMPLES, "Warp Stall Sampling (Not-issued Samples)", "# Samples",
          sass_profile.EXECUTED, *(f"stall_{r}" for r in REASONS), *(f"stall_{r} (Not Issued)" for r in REASONS)]


def _export(kernels) -> str:
    """A source-page CSV of kernels [(name, [(source, executed, {reason: samples}), ...])], as ncu writes it."""
    lines = []
    for name, rows in kernels:
        lines.append(f'"Kernel Name","{name}",')
        lines.append(",".join(f'"{c}"' for c in HEADER))
        for k, (source, executed, stalls) in enumerate(rows):
            total = sum(stalls.values())
            not_issued = total - stalls.get("selected", 0)
            cells = [f"0x{0x7f00 + 16 * k:x}", f"      {source}", total, not_issued, total, executed,
                     *(stalls.get(r, 0) for r in REASONS), *(0 if r == "selected" else stalls.get(r, 0) for r in REASONS)]
            lines.append(",".join(f'"{c}"' for c in cells))
    return "\n".join(lines) + "\n"


def _random_kernel(rng, name, n):
    ops = ["@!P0  BRA 0x7f00", "HGMMA.64x128x16.F32 R24, gdesc[UR16], R24", "MUFU.EX2 R3, R3", "@UP0 UIADD3 UR4, UR4, 0x1, URZ",
           "FMNMX R2, R2, R5, !PT", "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    rows = []
    for _ in range(n):
        stalls = {r: rng.randint(1, 50) for r in rng.sample(REASONS, rng.randint(1, len(REASONS)))}
        rows.append((rng.choice(ops), rng.choice([1056, 32768, 229376]), stalls))
    return name, rows


def test_parse_sums_every_kernel_of_the_export():
    rng = random.Random()
    kernels = [_random_kernel(rng, "qattn_prefill_x", rng.randint(20, 60)), _random_kernel(rng, "cudnn_y", 17)]
    parsed = sass_profile.parse(_export(kernels))
    assert [k.name for k in parsed] == ["qattn_prefill_x", "cudnn_y"]
    for (name, rows), kernel in zip(kernels, parsed):
        assert len(kernel.instructions) == len(rows)
        assert kernel.samples == sum(sum(s.values()) for _, _, s in rows)
        assert kernel.executed == sum(e for _, e, _ in rows)
        shares = sass_profile.stall_shares(kernel)
        assert pytest.approx(sum(shares.values())) == 1.0  # issued and not: every sample has one reason
        for reason, share in shares.items():
            assert share == pytest.approx(sum(s.get(reason, 0) for _, _, s in rows) / kernel.samples)
        assert list(shares.values()) == sorted(shares.values(), reverse=True)


def test_a_kernel_the_export_repeats_is_read_once():
    """ncu's source page lists every launch of a multi-launch report twice; two launches of one kernel (their
    samples differ) stay two."""
    rng = random.Random()
    quant, attention = _random_kernel(rng, "quant_qkv", 23), _random_kernel(rng, "attention", 31)
    again = _random_kernel(rng, "attention", 31)
    parsed = sass_profile.parse(_export([quant, quant, attention, attention, again]))
    assert [k.name for k in parsed] == ["quant_qkv", "attention", "attention"]
    assert parsed[1] != parsed[2]


def test_opcodes_drop_predicates_and_modifiers():
    text = _export([("k", [("@!P0  BRA 0x7f00", 1, {"long_sb": 3}), ("@UP0 UIADD3 UR4, UR4, 0x1, URZ", 1, {"wait": 1}),
                           ("HGMMA.64x128x16.F32 R24, gdesc[UR16], R24", 8, {"wait": 4}),
                           ("@!PT LDS R7, [R4+0x70]", 2, {"barrier": 2}), ("EXIT", 1, {"selected": 1})])])
    ops = [i.opcode for i in sass_profile.parse(text)[0].instructions]
    assert ops == ["BRA", "UIADD3", "HGMMA", "LDS", "EXIT"]


def test_by_opcode_and_by_count_group_the_samples():
    rows = [("MUFU.EX2 R1, R1", 100, {"wait": 6, "selected": 2}), ("FADD R1, R1, R2", 100, {"selected": 3}),
            ("MUFU.EX2 R2, R2", 100, {"wait": 5}), ("STG.E.128 [R2.64], R4", 7, {"long_sb": 9}),
            ("BRA 0x7f00", 0, {})]
    kernel = sass_profile.parse(_export([("k", rows)]))[0]
    by_op = {r["opcode"]: r for r in sass_profile.by_opcode(kernel)}
    assert by_op["MUFU"]["samples"] == pytest.approx(13 / 25) and by_op["MUFU"]["main_stall"] == "wait"
    assert by_op["MUFU"]["executed"] == pytest.approx(200 / 307)
    assert by_op["STG"]["main_stall"] == "long_sb" and by_op["BRA"]["main_stall"] == "-"
    stages = sass_profile.by_count(kernel)
    assert [(s["executed"], s["instructions"], s["first"], s["last"]) for s in stages] == [(100, 3, 0, 2), (7, 1, 3, 3)]
    assert stages[0]["samples"] == pytest.approx(16 / 25)
    hot = sass_profile.hottest(kernel, 2)
    assert [h["index"] for h in hot] == [3, 0] and hot[1]["stalls"] == {"wait": 0.75, "selected": 0.25}


def test_an_export_without_samples_is_refused_by_name():
    with pytest.raises(ValueError, match="SourceCounters"):
        sass_profile.parse('"Kernel Name","k",\n"Address","Source"\n"0x0","EXIT"\n')
    with pytest.raises(ValueError, match="no kernel"):
        sass_profile.parse("==PROF== nothing profiled\n")


def test_the_tool_reads_a_saved_export(tmp_path):
    rng = random.Random()
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(_export([_random_kernel(rng, "qattn_prefill_x", 40), _random_kernel(rng, "cudnn_y", 30)]))
    out = tmp_path / "s.json"
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_sass.py"), "--csv", str(path), "--top", "5",
                             "--json", str(out)], capture_output=True, text=True, check=True)
    assert "qattn_prefill_x" in result.stdout and "by execution count" in result.stdout
    summaries = json.loads(out.read_text())
    assert [s["kernel"] for s in summaries] == ["qattn_prefill_x", "cudnn_y"]
    assert all(len(s["hottest"]) == 5 for s in summaries)


def test_the_tool_refuses_a_bad_shape():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_sass.py"), "--shape", "16x32"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "BATCHxHEADSxSEQ" in result.stderr

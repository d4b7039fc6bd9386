"""Where a kernel's warps stall, instruction by instruction: Nsight Compute's source page (`ncu -i REPORT
--page source --print-source sass --csv`, a report taken with the SourceCounters section) read into one record
per SASS instruction, and summed by stall reason, by opcode and by execution count.

The sampler records, every few cycles, what each warp of the SM is doing and charges the sample to the instruction
the warp is at, with the reason it did not issue (or `selected`: it issued). So a kernel's samples by opcode say
which instructions its warps spend their time at, and the reasons say why. Instructions that ran the same number of
times form one stage of the kernel's schedule (a key loop's body, the code once per work item, a producer's
loop): `by_count` sums the samples of each such stage, which reads a SASS listing by where it runs without source
lines.
"""
from __future__ import annotations

import csv
import io
import re
from collections import defaultdict
from dataclasses import dataclass

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
STALL_PREFIX = "stall_"
NOT_ISSUED = "(Not Issued)"
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


@dataclass(frozen=True)
class Instruction:
    index: int  # position in the kernel's listing
    address: str
    source: str  # the SASS text, e.g. "@!P0 BRA 0x7f..."
    samples: float  # warp stall samples charged to it, issued or not
    executed: float  # warp instructions executed
    stalls: dict  # stall reason (without the "stall_" prefix) -> samples

    @property
    def opcode(self) -> str:
        """The mnemonic without its predicate and modifiers: "@!P0 BRA 0x.." -> "BRA", "HGMMA.64x128x16.F32" ->
        "HGMMA"."""
        text = _PREDICATE.sub("", self.source.strip())
        return text.split(" ", 1)[0].split(".", 1)[0]


@dataclass(frozen=True)
class KernelSass:
    name: str
    instructions: tuple

    @property
    def samples(self) -> float:
        return sum(i.samples for i in self.instructions)

    @property
    def executed(self) -> float:
        return sum(i.executed for i in self.instructions)


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def parse(text: str) -> list[KernelSass]:
    """Every kernel of a source-page export: a `"Kernel Name","NAME"` line, then a header row and one row per
    SASS instruction. ValueError when the text holds no kernel or a kernel's header lacks the sample columns (an
    export of another page, or a report without the SourceCounters section)."""
    kernels: list[KernelSass] = []
    name, header, rows = None, None, []

    def close():
        # ncu's export lists a report's kernels twice when it holds several launches: a copy of one read already,
        # row for row, is the same launch
        if name is not None and KernelSass(name, tuple(rows)) not in kernels:
            kernels.append(KernelSass(name, tuple(rows)))

    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            close()
            name, header, rows = row[1] if len(row) > 1 else "", None, []
            continue
        if name is None:
            continue
        if header is None:
            header = row
            missing = [c for c in ("Address", "Source", SAMPLES, EXECUTED) if c not in header]
            if missing:
                raise ValueError(f"kernel {name!r}: the export has no {', '.join(missing)} column (take the report "
                                 "with --section SourceCounters, export it with --page source --print-source sass)")
            columns = {c: header.index(c) for c in ("Address", "Source", SAMPLES, EXECUTED)}
            stall_columns = [(c[len(STALL_PREFIX):], k) for k, c in enumerate(header)
                             if c.startswith(STALL_PREFIX) and NOT_ISSUED not in c]
            continue
        value = dict(zip(header, row))
        stalls = {reason: _number(row[k]) for reason, k in stall_columns if k < len(row) and _number(row[k])}
        rows.append(Instruction(len(rows), value["Address"], value["Source"].strip(), _number(row[columns[SAMPLES]]),
                                _number(row[columns[EXECUTED]]), stalls))
    close()
    if not kernels:
        raise ValueError("no kernel in the export (expected a \"Kernel Name\" line before each kernel's rows)")
    return kernels


def stall_shares(kernel: KernelSass) -> dict[str, float]:
    """Each stall reason's share of the kernel's samples, largest first."""
    total = kernel.samples or 1.0
    sums: dict[str, float] = defaultdict(float)
    for ins in kernel.instructions:
        for reason, n in ins.stalls.items():
            sums[reason] += n
    return {r: n / total for r, n in sorted(sums.items(), key=lambda x: -x[1])}


def by_opcode(kernel: KernelSass) -> list[dict]:
    """Per opcode: its share of the samples and of the executed instructions, and its main stall reason; most
    sampled first."""
    total, executed = kernel.samples or 1.0, kernel.executed or 1.0
    groups: dict[str, list[Instruction]] = defaultdict(list)
    for ins in kernel.instructions:
        groups[ins.opcode].append(ins)
    rows = []
    for op, members in groups.items():
        stalls: dict[str, float] = defaultdict(float)
        for ins in members:
            for reason, n in ins.stalls.items():
                stalls[reason] += n
        main = max(stalls.items(), key=lambda x: x[1])[0] if stalls else "-"
        rows.append({"opcode": op, "samples": sum(i.samples for i in members) / total,
                     "executed": sum(i.executed for i in members) / executed, "main_stall": main})
    return sorted(rows, key=lambda r: -r["samples"])


def by_count(kernel: KernelSass) -> list[dict]:
    """The kernel's stages by execution count: instructions that ran equally often, their number, first and last
    listing index, and share of the samples; most sampled first. Instructions that never ran are left out."""
    total = kernel.samples or 1.0
    groups: dict[float, list[Instruction]] = defaultdict(list)
    for ins in kernel.instructions:
        if ins.executed:
            groups[ins.executed].append(ins)
    rows = [{"executed": count, "instructions": len(members), "first": members[0].index, "last": members[-1].index,
             "samples": sum(i.samples for i in members) / total} for count, members in groups.items()]
    return sorted(rows, key=lambda r: -r["samples"])


def hottest(kernel: KernelSass, top: int) -> list[dict]:
    """The `top` most sampled instructions, with their two main stall reasons."""
    total = kernel.samples or 1.0
    rows = []
    for ins in sorted(kernel.instructions, key=lambda i: -i.samples)[:top]:
        reasons = sorted(ins.stalls.items(), key=lambda x: -x[1])[:2]
        rows.append({"index": ins.index, "samples": ins.samples / total, "executed": ins.executed,
                     "stalls": {r: n / (ins.samples or 1.0) for r, n in reasons}, "source": ins.source})
    return rows


def summary(kernel: KernelSass, top: int = 20) -> dict:
    """Everything above for one kernel, as plain data (the tool's JSON)."""
    return {"kernel": kernel.name, "samples": kernel.samples, "executed": kernel.executed,
            "sass_instructions": len(kernel.instructions), "stalls": stall_shares(kernel),
            "by_opcode": by_opcode(kernel), "by_count": by_count(kernel), "hottest": hottest(kernel, top)}

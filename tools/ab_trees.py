#!/usr/bin/env python3
"""Time one qattn benchmark in two or more source trees, each run in its own process, the trees in turn
round after round (the order reversed every other round), and compare the same records across trees.

A kernel change is judged against the kernel before it on the same GPU in the same session: run-to-run
drift on a power-capped GPU is as large as the changes worth measuring, so the trees alternate and each
record's median over the rounds is compared. The benchmark is any `qattn` command that writes its
records with `--json FILE` (`bench decode`, `bench paged-read`, ...); the records of each list in that
file are matched across trees by their identifying fields (shape, page size, implementation, ...).

    git archive main qattn | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    tools/ab_trees.py --tree base=/tmp/base --tree new=. --rounds 3 -- \\
        bench decode --shape 8x32768 --page-size 16 -f e4m3-e4m3 --rounds 1 --write-tokens 0

Every tree shares the kernel cache (entries are keyed by their source), so a tree's kernels compile once.

The peers' records (an implementation not named qattn:...) run the same code in every tree, so how far their
times move between trees is the runs' own spread: the summary names the largest such move, and a qattn
record's change of that size or less belongs to the runs, not to the trees. Separate processes on one GPU can
spread several percent at short calls; a kernel option is better timed against its absence in one process
(`qattn bench -f FORMAT,FORMAT+OPTION ...`, interleaved rounds).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# the fields a record is measured in; every other str or int field identifies it
MEASURED = ("ms", "round_ms", "gbs", "of_copy", "copy_gbs", "rel_l2_vs_fp16")
# the fields that say how a record ran (a kernel, its split and merge), which trees may choose differently
HOW = ("kernel", "splits", "merge")


def parse_tree(text: str) -> tuple[str, Path]:
    """NAME=DIR -> (NAME, DIR) where DIR holds a qattn package."""
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    path = Path(folder).expanduser().resolve()
    if not (path / "qattn" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: {path} holds no qattn package (qattn/__init__.py)")
    return name, path


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The trees' order in each round: as given, then reversed, in turn (so no tree always follows the same
    one on a GPU whose clock recovers from the previous run)."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def record_key(record: dict) -> tuple:
    """What identifies a record across runs: its str, int and bool fields (a prefill record's causal flag),
    measurements excluded."""
    return tuple(sorted((k, v) for k, v in record.items()
                        if k not in MEASURED and k not in HOW and not k.startswith("vs_") and isinstance(v, (str, int))))


def records_of(result) -> list[dict]:
    """Every record in a --json result: a list of records, or the dicts of an object's list-valued entries."""
    lists = [result] if isinstance(result, list) else [v for v in result.values() if isinstance(v, list)]
    return [r for records in lists for r in records if isinstance(r, dict)]


def collect(runs: dict[str, list]) -> dict[tuple, dict[str, list[dict]]]:
    """{record key: {tree: [the record of each round]}} from {tree: [each round's --json result]}."""
    table: dict[tuple, dict[str, list[dict]]] = {}
    for tree, results in runs.items():
        for result in results:
            for record in records_of(result):
                if record.get("ms") is not None:
                    table.setdefault(record_key(record), {}).setdefault(tree, []).append(record)
    return table


LABEL_FIELDS = ("impl", "batch", "ctx", "page_size", "head_dim", "heads", "kv_heads", "queries", "scale", "qk",
                "k_term", "l2", "format", "mode")


def label(key: tuple) -> str:
    """A record's name in the summary: its implementation, BATCHxLENGTH (a decode record's context, a prefill
    record's sequence), "causal" where it is, and the other fields that tell records apart."""
    fields = dict(key)
    length = fields.get("ctx", fields.get("seq"))
    shape = f"{fields['batch']}x{length}" if "batch" in fields and length is not None else ""
    rest = [f"{k} {fields[k]}" for k in LABEL_FIELDS if k in fields and k not in ("impl", "batch", "ctx")]
    return " ".join(x for x in (str(fields.get("impl", "")), shape, "causal" if fields.get("causal") else "",
                                ", ".join(rest)) if x)


def summary_rows(table: dict, names: list[str]) -> list[dict]:
    """Per record: each tree's median ms (and of_copy where recorded) over the rounds, and each later tree's
    time over the first tree's (< 1: faster)."""
    rows = []
    for key, by_tree in table.items():
        ms = {t: statistics.median(r["ms"] for r in by_tree[t]) for t in names if t in by_tree}
        of_copy = {t: statistics.median(r["of_copy"] for r in by_tree[t]) for t in names
                   if t in by_tree and all(r.get("of_copy") is not None for r in by_tree[t])}
        base = ms.get(names[0])
        ratio = {t: ms[t] / base for t in names[1:] if t in ms and base}
        rows.append({"label": label(key), "ms": ms, "of_copy": of_copy, "ratio": ratio,
                     "rounds": {t: len(by_tree[t]) for t in by_tree}})
    return sorted(rows, key=lambda row: row["label"])


def is_control(row: dict) -> bool:
    """Whether a summary row times code that no tree changes (a peer: an implementation not named qattn:...)."""
    return not row["label"].startswith("qattn:")


def control_drift(rows: list[dict], names: list[str]) -> dict[str, dict]:
    """Per later tree, the control row whose time over the first tree's lies farthest from 1 ({"label", "ratio"});
    trees with no control row in common with the first are left out."""
    drift = {}
    for t in names[1:]:
        controls = [row for row in rows if is_control(row) and t in row["ratio"]]
        if controls:
            worst = max(controls, key=lambda row: abs(row["ratio"][t] - 1))
            drift[t] = {"label": worst["label"], "ratio": worst["ratio"][t]}
    return drift


def print_drift(drift: dict[str, dict], names: list[str]) -> None:
    for t, worst in drift.items():
        print(f"controls: {worst['label']} read {worst['ratio']:.3f} of its time in {t} against {names[0]}: "
              f"changes of {abs(worst['ratio'] - 1):.1%} or less belong to the runs, not the trees")


def print_table(rows: list[dict], names: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"time and fraction of copy per tree; time over {names[0]}'s")
    table.add_column("record")
    for t in names:
        table.add_column(f"{t} ms", justify="right")
        table.add_column(f"{t} of copy", justify="right")
    for t in names[1:]:
        table.add_column(f"{t} / {names[0]}", justify="right")
    for row in rows:
        cells = [row["label"]]
        for t in names:
            cells += [f"{row['ms'][t]:.4f}" if t in row["ms"] else "-",
                      f"{row['of_copy'][t]:.3f}" if t in row["of_copy"] else "-"]
        cells += [f"{row['ratio'][t]:.3f}" if t in row["ratio"] else "-" for t in names[1:]]
        table.add_row(*cells)
    Console().print(table)


def run_once(folder: Path, command: list[str], out: Path) -> dict:
    """One run of `python -m qattn.cli COMMAND --json OUT` with the tree's package first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    subprocess.run([sys.executable, "-m", "qattn.cli", *command, "--json", str(out)], cwd=folder, env=env, check=True)
    return json.loads(out.read_text())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="%(prog)s --tree NAME=DIR --tree NAME=DIR [--rounds N] [--json FILE] -- "
                                       "QATTN_COMMAND ...")
    ap.add_argument("--tree", dest="trees", action="append", type=parse_tree, required=True, metavar="NAME=DIR",
                    help="a source tree to time (the first is the base of the ratios); give two or more")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each tree, in turn [default: 3]")
    ap.add_argument("--json", type=Path, help="also write every run's records and the summary as JSON")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the qattn command and its options, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    names = [name for name, _ in args.trees]
    if len(args.trees) < 2:
        ap.error("--tree: give two or more trees to compare")
    if len(set(names)) != len(names):
        ap.error(f"--tree: names must differ, got {', '.join(names)}")
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive integer, got {args.rounds}")
    if not command:
        ap.error("give the qattn command to time after --, e.g. -- bench decode --shape 8x32768")
    if "--json" in command:
        ap.error("the command's --json is the tool's own: leave it out of the command")
    args.command = command
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    folders = dict(args.trees)
    names = list(folders)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as scratch:
        for r, order in enumerate(round_orders(names, args.rounds)):
            for name in order:
                print(f"round {r + 1}/{args.rounds}: {name} ({folders[name]})", file=sys.stderr, flush=True)
                runs[name].append(run_once(folders[name], args.command, Path(scratch) / f"{name}-{r}.json"))
    rows = summary_rows(collect(runs), names)
    if not rows:
        print("ab_trees: the command's --json records hold no times (no record with an 'ms'): nothing to compare",
              file=sys.stderr)
        return 1
    print_table(rows, names)
    drift = control_drift(rows, names)
    print_drift(drift, names)
    if args.json:
        args.json.write_text(json.dumps({"trees": {n: str(f) for n, f in folders.items()}, "command": args.command,
                                         "runs": runs, "summary": rows, "control_drift": drift}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tools/ab_trees.py without a GPU: the trees' order, the records matched across trees, the summary, and a
whole run over two stand-in trees whose qattn.cli writes known records. CPU only."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import ab_trees  # noqa: E402


def _record(impl, ms, page=16, of_copy=None):
    rec = {"batch": 8, "ctx": 32768, "page_size": page, "impl": impl, "ms": ms, "round_ms": [ms], "gbs": 1.0,
           "vs_sdpa_cudnn": 1.5, "copy_gbs": 4000.0}
    if of_copy is not None:
        rec["of_copy"] = of_copy
    return rec


def _tree(root: Path, name: str, ms: dict) -> Path:
    """A stand-in source tree whose `python -m qattn.cli ... --json FILE` writes records of these times."""
    package = root / name / "qattn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text(textwrap.dedent(f"""
        import json, sys
        args = sys.argv[1:]
        assert args[:2] == ["bench", "decode"], args
        records = [{{"impl": impl, "batch": 8, "ctx": 4096, "ms": ms, "of_copy": ms and 0.5 / ms}}
                   for impl, ms in {ms!r}.items()]
        open(args[args.index("--json") + 1], "w").write(json.dumps({{"meta": {{"tree": {name!r}}}, "decode": records}}))
    """))
    return root / name


def test_round_orders_alternate():
    assert ab_trees.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_record_key_leaves_out_measurements():
    a, b = _record("qattn:e4m3-e4m3", 0.13, of_copy=0.9), _record("qattn:e4m3-e4m3", 0.17)
    assert ab_trees.record_key(a) == ab_trees.record_key(b)
    assert ab_trees.record_key(a) != ab_trees.record_key(_record("qattn:e4m3-e4m3", 0.13, page=32))
    assert dict(ab_trees.record_key(a)) == {"batch": 8, "ctx": 32768, "page_size": 16, "impl": "qattn:e4m3-e4m3"}
    # how a tree ran the record (its split and merge) is no part of what the record is
    ran = dict(a, kernel="decode_e4m3-e4m3_d128", splits=8, merge="cluster")
    assert ab_trees.record_key(ran) == ab_trees.record_key(dict(a, splits=4, merge="kernel"))


def test_prefill_records_keep_causal_apart_and_name_their_length():
    """`qattn bench` (prefill) records carry seq and a causal flag: the same shape causal and not are two records,
    each labelled with its length."""
    rec = {"batch": 16, "heads": 32, "seq": 1024, "head_dim": 128, "causal": False, "impl": "qattn:f16", "ms": 0.6,
           "kernel": "prefill_f16_d128_m128n128w8s2_wgmma_sm90a", "rel_l2": 2.8e-4, "tflops": 450.0}
    causal = dict(rec, causal=True, ms=0.4)
    assert ab_trees.record_key(rec) != ab_trees.record_key(causal)
    rows = ab_trees.summary_rows(ab_trees.collect({"base": [[rec, causal]], "new": [[dict(rec, ms=0.5), causal]]}),
                                 ["base", "new"])
    assert [row["label"] for row in rows] == ["qattn:f16 16x1024 causal head_dim 128, heads 32",
                                              "qattn:f16 16x1024 head_dim 128, heads 32"]
    assert rows[0]["ratio"]["new"] == pytest.approx(1.0) and rows[1]["ratio"]["new"] == pytest.approx(0.5 / 0.6)


def test_records_of_a_list_or_an_object():
    rec = _record("x", 0.1)
    assert ab_trees.records_of([rec, "note"]) == [rec]  # `qattn parity --json` writes a list
    assert ab_trees.records_of({"meta": {"gpu": "H200"}, "decode": [rec], "write": []}) == [rec]


def test_summary_takes_medians_and_ratios_against_the_first_tree():
    runs = {"base": [{"decode": [_record("x", ms, of_copy=0.8)]} for ms in (0.20, 0.22, 0.21)],
            "new": [{"decode": [_record("x", ms, of_copy=0.95), _record("y", 1.0)], "meta": {"gpu": "H200"}}
                    for ms in (0.16, 0.17, 0.18)]}
    rows = ab_trees.summary_rows(ab_trees.collect(runs), ["base", "new"])
    x, y = rows
    assert x["label"] == "x 8x32768 page_size 16" and x["ms"] == {"base": 0.21, "new": 0.17}
    assert x["ratio"]["new"] == pytest.approx(0.17 / 0.21) and x["of_copy"] == {"base": 0.8, "new": 0.95}
    assert x["rounds"] == {"base": 3, "new": 3}
    assert y["ms"] == {"new": 1.0} and y["ratio"] == {} and y["of_copy"] == {}  # only one tree has it


def test_a_run_over_two_trees(tmp_path, capsys, monkeypatch):
    base = _tree(tmp_path, "base", {"qattn:f16-f16": 0.25, "sdpa_cudnn": 0.24})
    new = _tree(tmp_path, "new", {"qattn:f16-f16": 0.20, "sdpa_cudnn": 0.24})
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "ab.json"
    assert ab_trees.main(["--tree", f"base={base}", "--tree", f"new={new}", "--rounds", "2", "--json", str(out),
                          "--", "bench", "decode", "--shape", "8x4096"]) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert err.index("round 1/2: base") < err.index("round 1/2: new") < err.index("round 2/2: new") \
        < err.index("round 2/2: base")
    data = json.loads(out.read_text())
    assert [r["meta"]["tree"] for r in data["runs"]["new"]] == ["new", "new"]  # each tree imports its own qattn
    rows = {row["label"]: row for row in data["summary"]}
    assert rows["qattn:f16-f16 8x4096"]["ratio"]["new"] == pytest.approx(0.8)
    assert rows["sdpa_cudnn 8x4096"]["ratio"]["new"] == pytest.approx(1.0)
    assert data["command"] == ["bench", "decode", "--shape", "8x4096"]
    assert data["control_drift"] == {"new": {"label": "sdpa_cudnn 8x4096", "ratio": pytest.approx(1.0)}}
    assert "controls: sdpa_cudnn 8x4096 read 1.000 of its time in new against base" in captured.out


def test_control_drift_names_the_peer_that_moved_most():
    """A peer runs the same code in every tree: its move between trees is the runs' spread, the bar a qattn
    record's change must clear. qattn records never count as controls."""
    rows = [{"label": "qattn:f16 16x1024 causal", "ratio": {"new": 0.93, "other": 0.90}},
            {"label": "sdpa_cudnn 16x1024 causal", "ratio": {"new": 1.034, "other": 0.99}},
            {"label": "sdpa_cudnn 4x4096 causal", "ratio": {"new": 0.996, "other": 0.97}},
            {"label": "sdpa_flash 4x4096", "ratio": {"other": 1.01}}]
    drift = ab_trees.control_drift(rows, ["base", "new", "other"])
    assert drift == {"new": {"label": "sdpa_cudnn 16x1024 causal", "ratio": 1.034},
                     "other": {"label": "sdpa_cudnn 4x4096 causal", "ratio": 0.97}}
    assert ab_trees.control_drift(rows[:1], ["base", "new"]) == {}  # no peer timed: nothing to say


def test_a_run_without_times_says_so(tmp_path, capsys):
    base, new = (_tree(tmp_path, name, {"qattn:f16-f16": None}) for name in ("base", "new"))
    assert ab_trees.main(["--tree", f"base={base}", "--tree", f"new={new}", "--rounds", "1", "--", "bench",
                          "decode"]) == 1
    assert "hold no times" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--tree", "a=.", "--", "bench", "decode"], "two or more trees"),
    (["--tree", "a=.", "--tree", "a=.", "--", "bench", "decode"], "names must differ"),
    (["--tree", "a=.", "--tree", "b=."], "give the qattn command"),
    (["--tree", "a=.", "--tree", "b=.", "--", "bench", "decode", "--json", "x"], "the command's --json"),
    (["--tree", "a", "--tree", "b=.", "--", "bench"], "expected NAME=DIR"),
    (["--tree", "a=/nonexistent", "--tree", "b=.", "--", "bench"], "holds no qattn package"),
    (["--tree", "a=.", "--tree", "b=.", "--rounds", "0", "--", "bench"], "--rounds"),
])
def test_usage_errors(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    with pytest.raises(SystemExit) as exit_info:
        ab_trees.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err

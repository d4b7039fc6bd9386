"""The tools' size arguments (--shape 16x32x1024 and the like): parsed and checked in one place, for argparse."""
from __future__ import annotations

import argparse

BATCH_HEADS_SEQ = ("BATCH", "HEADS", "SEQ")


def parse_sizes(text: str, names=BATCH_HEADS_SEQ, sep: str = "x") -> tuple[int, ...]:
    """'16x32x1024' -> (16, 32, 1024): one positive integer per name, joined by sep (case-insensitive). An
    argparse.ArgumentTypeError names the expected form otherwise, so argparse reports it against the option."""
    parts = text.lower().split(sep)
    if len(parts) != len(names) or not all(p.isdigit() and int(p) > 0 for p in parts):
        example = sep.join(str(n) for n in (16, 32, 1024, 128)[:len(names)])
        raise argparse.ArgumentTypeError(f"expected {sep.join(names)} of positive sizes, e.g. {example}, got {text!r}")
    return tuple(int(p) for p in parts)


def sizes(names=BATCH_HEADS_SEQ, sep: str = "x"):
    """An argparse `type` that parses sizes named `names` (parse_sizes)."""
    def parse(text: str) -> tuple[int, ...]:
        return parse_sizes(text, names, sep)

    parse.__name__ = sep.join(names)  # argparse names the type in its messages
    return parse

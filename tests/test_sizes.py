"""qattn.bench.sizes: the tools' --shape arguments. CPU only."""
import argparse
import random

import pytest

from qattn.bench.sizes import BATCH_HEADS_SEQ, parse_sizes, sizes


def test_sizes_parse_any_positive_sizes():
    rng = random.Random()
    for _ in range(50):
        values = tuple(rng.randint(1, 1 << 20) for _ in range(3))
        assert parse_sizes("x".join(map(str, values))) == values
        assert parse_sizes("/".join(map(str, values)), sep="/") == values
    assert parse_sizes("1X8X77") == (1, 8, 77)
    assert sizes((*BATCH_HEADS_SEQ, "HEAD_DIM"))("4x32x4096x128") == (4, 32, 4096, 128)


@pytest.mark.parametrize("text", ["4x32", "4x32x0", "axbxc", "4x32x4096x1", "4x-1x8", "", "4x32x4096/"])
def test_bad_sizes_name_the_expected_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected BATCHxHEADSxSEQ of positive sizes"):
        parse_sizes(text)


def test_the_argparse_type_reports_against_the_option():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", type=sizes(sep="/"), action="append")
    assert parser.parse_args(["--shape", "2/4/8", "--shape", "1/1/1"]).shape == [(2, 4, 8), (1, 1, 1)]
    with pytest.raises(SystemExit):
        parser.parse_args(["--shape", "2x4x8"])

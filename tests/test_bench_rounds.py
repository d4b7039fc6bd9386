"""The timing helpers that need no GPU to check: interleaved rounds (runtime.bench.time_interleaved,
with a fake timer) and time_queued's argument check."""
import pytest

from qattn.runtime.bench import time_interleaved


def test_rounds_visit_every_function_in_turn():
    order = []

    def timer(fn, rounds):
        assert rounds == 3
        order.append(fn())
        return 10.0 * len(order)

    times = time_interleaved([lambda: "a", lambda: "b"], rounds=3, timer=timer)
    assert order == ["a", "b"] * 3  # round-robin, not all of a's runs first
    assert times == [[10.0, 30.0, 50.0], [20.0, 40.0, 60.0]]


@pytest.mark.parametrize("rounds", [0, -2])
def test_rounds_must_be_positive(rounds):
    with pytest.raises(ValueError, match="rounds: expected a positive integer"):
        time_interleaved([lambda: None], rounds=rounds, timer=lambda fn, n: 1.0)


def test_time_queued_needs_calls():
    from qattn.runtime.bench import time_queued

    with pytest.raises(ValueError, match="calls: expected a positive integer"):
        time_queued(lambda: None, calls=0)

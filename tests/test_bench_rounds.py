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
    assert order == ["a", "b", "b", "a", "a", "b"]  # every fn once a round, not all of a's first
    assert times == [[10.0, 40.0, 50.0], [20.0, 30.0, 60.0]]  # per fn, in round order


def test_odd_rounds_run_in_reverse():
    # No fn always follows the same one (on a power-capped GPU the one after a hungry kernel
    # starts at a lower clock): each neighbouring pair runs in both orders.
    order = []
    fns = [lambda c=c: c for c in "abc"]
    time_interleaved(fns, rounds=2, timer=lambda fn, n: order.append(fn()) or 1.0)
    assert order == list("abc") + list("cba")
    followers = {(order[i - 1], order[i]) for i in range(1, len(order)) if i % 3}
    assert followers == {("a", "b"), ("b", "c"), ("c", "b"), ("b", "a")}


@pytest.mark.parametrize("rounds", [0, -2])
def test_rounds_must_be_positive(rounds):
    with pytest.raises(ValueError, match="rounds: expected a positive integer"):
        time_interleaved([lambda: None], rounds=rounds, timer=lambda fn, n: 1.0)


def test_time_queued_needs_calls():
    from qattn.runtime.bench import time_queued

    with pytest.raises(ValueError, match="calls: expected a positive integer"):
        time_queued(lambda: None, calls=0)

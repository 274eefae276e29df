"""The GPU tests' order under xdist (tests/scheduling.py), on plain values."""

from __future__ import annotations

from scheduling import spread_long_tests


def shares(items: list, workers: int) -> list[list]:
    """How xdist's work stealing first splits `items` (contiguous, len // nodes left in turn)."""
    out, left = [], list(items)
    for remaining in range(workers, 0, -1):
        n = len(left) // remaining
        out.append(left[:n])
        left = left[n:]
    return out


def test_each_worker_starts_on_a_long_test_and_loads_balance():
    seconds = {"soak-x": 200, "soak-g": 160, "soak-s": 140, "hf-1": 120, "hf-2": 90, "hf-3": 80, "soak-f": 70}
    items = [f"t{i}" for i in range(20)] + list(seconds)  # collected by file: the long ones last
    ordered = spread_long_tests(items, 3, lambda item: seconds.get(item, 0))
    assert sorted(ordered) == sorted(items)
    first = shares(ordered, 3)
    assert [share[0] for share in first] == ["soak-x", "soak-g", "soak-s"]
    long_load = [sum(seconds.get(i, 0) for i in share) for share in first]
    assert max(long_load) - min(long_load) <= 70  # greedy onto the lightest: 280, 320, 260
    assert [i for i in ordered if i not in seconds] == [f"t{i}" for i in range(20)]  # short ones keep their order


def test_one_worker_or_no_long_tests_keep_the_collection_order():
    items = ["a", "b", "c", "d"]
    assert spread_long_tests(items, 1, lambda item: 5.0) == items
    assert spread_long_tests(items, 4, lambda item: 0.0) == items

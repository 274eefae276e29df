"""The order of the GPU tests under pytest-xdist's work stealing: the longest first, one per worker.

`--dist worksteal` hands worker i the i-th of W equal contiguous shares of the collection and lets
an idle worker take the back half of the longest queue. Collected by file name, the soak and
transformers tests (2-3 minutes each on an H100 with six workers sharing the card) sit at the end,
in one or two shares, and ran one after another while the other workers idled (an H100 run of
525 s, of which the four soaks alone were 572 s of work). Placed here, each long test opens a
share, largest first onto the lightest, and the short ones fill the shares' backs, where stealing
takes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def spread_long_tests(items: Sequence[T], workers: int, seconds: Callable[[T], float]) -> list[T]:
    """`items` reordered for `workers` xdist workers: the tests with `seconds(item) > 0`, longest
    first, each at the front of the share whose long tests sum the least so far; the rest keep
    their order and fill the shares to the sizes xdist gives them. One worker: unchanged."""
    if workers < 2:
        return list(items)
    sizes, left = [], len(items)
    for remaining in range(workers, 0, -1):  # xdist's split: len(pending) // nodes left, in turn
        sizes.append(left // remaining)
        left -= sizes[-1]
    shares: list[list[T]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for item in sorted((i for i in items if seconds(i) > 0), key=seconds, reverse=True):
        lightest = min(range(workers), key=load.__getitem__)
        shares[lightest].append(item)
        load[lightest] += seconds(item)
    short = iter([i for i in items if seconds(i) <= 0])
    ordered = []
    for share, size in zip(shares, sizes, strict=True):
        ordered += share + list(itertools.islice(short, max(0, size - len(share))))
    return ordered + list(short)

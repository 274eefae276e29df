"""Which captured graph serves a step, or why it runs eagerly: pure host logic, no device.

A decode-only batch of n requests replays the graph of the smallest captured size >= n (its
rows n.. are pads) and, where the State captures several block-table widths per size, of the
narrowest width that holds its longest sequence. With piecewise graphs, any other step of at
most the largest token bucket replays the pieces of the smallest bucket that holds its tokens
(attention eager between them). Everything else runs the model eagerly, for one named reason.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import torch

from compiled_attn.validation import INT32_MAX, as_int

# vLLM's sizes: every small batch gets a close fit, larger ones pad by at most 7 rows.
DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 257, 8))

# Token buckets of the piecewise graphs: a step of more than 16 tokens pads by at most half.
DEFAULT_PIECEWISE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)

GRAPH = "graph"
PIECEWISE = "piecewise"  # pieces replayed per token bucket, attention eager between them
EAGER_PREFILL = "eager_prefill"  # the step has prefills (prefill-only or mixed)
EAGER_OVERSIZE = "eager_oversize"  # more decodes than the largest captured size
EAGER_OVERLONG = "eager_overlong"  # a sequence longer than spec.max_seq_len_to_capture
PATHS = (GRAPH, PIECEWISE, EAGER_PREFILL, EAGER_OVERSIZE, EAGER_OVERLONG)


def names_no_sizes(sizes: Iterable[int] | None) -> bool:
    """Whether `sizes` is an empty list of capture sizes (`[]`: no decode graphs), not a default."""
    return isinstance(sizes, list | tuple | range) and len(sizes) == 0


def capture_sizes_for(max_batch_size: int, sizes: Iterable[int] | None = None) -> list[int]:
    """The batch sizes to capture, largest first: `sizes` (default DEFAULT_CAPTURE_SIZES) up to
    `max_batch_size`, without duplicates.

    Largest first, so that smaller graphs reuse the shared pool's memory the largest one made.

    >>> capture_sizes_for(20)
    [16, 8, 4, 2, 1]
    """
    max_batch_size = as_int("max_batch_size", max_batch_size)
    return _largest_first(_checked_sizes(DEFAULT_CAPTURE_SIZES if sizes is None else sizes, "capture sizes"),
                          max_batch_size)


def piecewise_sizes_for(sizes: Iterable[int] | None = None) -> list[int]:
    """The token buckets of the piecewise graphs, largest first: `sizes` (default
    DEFAULT_PIECEWISE_SIZES), checked as capture sizes are.

    >>> piecewise_sizes_for([64, 8, 16, 8])
    [64, 16, 8]
    """
    if isinstance(sizes, list | tuple | range) and not len(sizes):
        raise ValueError("piecewise_sizes must name at least one token count")
    return sorted(set(_checked_sizes(DEFAULT_PIECEWISE_SIZES if sizes is None else sizes, "piecewise_sizes")),
                  reverse=True)


def _largest_first(sizes: list[int], max_batch_size: int) -> list[int]:
    """The checked `sizes` up to `max_batch_size`, largest first, without duplicates."""
    kept = sorted({s for s in sizes if s <= max_batch_size}, reverse=True)
    if not kept:
        raise ValueError(f"no capture size in {sorted(set(sizes))} is <= max_batch_size={max_batch_size}")
    return kept


def _checked_sizes(sizes: object, what: str) -> list[int]:
    """`sizes` as a list of python ints, each in [1, INT32_MAX] (numpy ints too, as `as_int`
    takes them); ValueError naming `what` and every bad entry otherwise."""
    if not isinstance(sizes, list | tuple | range):
        raise ValueError(f"{what} must be a list of ints, got {type(sizes).__name__}")
    checked, bad = [], []
    for s in sizes:
        try:
            checked.append(as_int(what, s))
        except ValueError:
            bad.append(s)
    if bad:
        raise ValueError(f"{what} must be ints in [1, {INT32_MAX}], got {bad}")
    return checked


def fill_padded(buffers: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], pads_from: int,
                pad_values: Sequence[int] | None = None) -> int:
    """A step's n rows of each source into the first rows of its static buffer, every row after
    them a pad: `pad_values[i]` in buffer i (default zeros: a valid id and position, whose rows'
    outputs are dropped; -1 for slots: pads write no cache).

    pads_from: the first row from which the buffers hold pads already (what the last call
    returned; 0 for new buffers): only rows an earlier, larger step wrote are padded again, so
    steps of one size fill no pads (each fill costs ~5 us of host time on a GPU). Returns n, the
    next call's `pads_from`.

    The copies are one foreach call (one launch on CUDA): each torch call costs an H200's host
    about 15 us (`scripts/runner_phases.py`), and this is on every step's critical path.
    """
    n = sources[0].shape[0]
    torch._foreach_copy_([buf[:n] for buf in buffers], list(sources), non_blocking=True)
    if n < pads_from:
        values = pad_values or [0] * len(buffers)
        zeros = [buf[n:pads_from] for buf, pad in zip(buffers, values, strict=True) if pad == 0]
        if zeros:  # the foreach op refuses an empty list
            torch._foreach_zero_(zeros)
        for buf, pad in zip(buffers, values, strict=True):
            if pad:
                buf[n:pads_from].fill_(pad)
    return n


def capture_widths_for(widths: Iterable[int], full_width: int) -> list[int]:
    """A State's block-table widths (`graph_table_widths()`), largest first, checked: ints in
    1..full_width, full_width among them (the width a step of the longest sequences needs).

    >>> capture_widths_for((16, 64, 32), 64)
    [64, 32, 16]
    """
    widths = list(widths)
    if not widths or any(not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= full_width for w in widths) \
            or full_width not in widths:
        raise ValueError(f"a State's graph_table_widths() must be ints in 1..{full_width} that include "
                         f"{full_width} (the full table), got {widths}")
    return sorted(set(widths), reverse=True)


def pick_batch_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest of `sizes` (any order) that holds `num_seqs` rows, or None if none does."""
    return _smallest_at_least(sizes, num_seqs)


def pick_table_width(widths: Iterable[int], max_seq_len: int, block_size: int) -> int | None:
    """The narrowest of `widths` (blocks, any order) whose table holds a sequence of `max_seq_len`
    tokens, or None if none does.

    >>> pick_table_width([64, 32, 16], max_seq_len=300, block_size=16)
    32
    """
    return _smallest_at_least(widths, max(1, -(-max_seq_len // block_size)))


def _smallest_at_least(values: Iterable[int], n: int) -> int | None:
    ascending = sorted(values)
    i = bisect.bisect_left(ascending, n)
    return ascending[i] if i < len(ascending) else None


def choose_path(
    *, num_prefills: int, num_seqs: int, max_seq_len: int, largest_size: int, max_seq_len_to_capture: int,
    num_tokens: int | None = None, largest_piecewise_tokens: int | None = None,
) -> str:
    """GRAPH, PIECEWISE, or the reason the step runs eagerly (checked in this order: prefill,
    oversize, overlong).

    Graphs replay decode-only steps (one token per request) of at most `largest_size` requests
    whose longest sequence fits the captured block tables. With piecewise graphs
    (`largest_piecewise_tokens`: the largest token bucket; None: none captured), every other
    step of at most that many tokens replays pieces: their attention runs eagerly, so it takes
    prefills and sequences of any length.

    >>> choose_path(num_prefills=0, num_seqs=3, max_seq_len=40, largest_size=8, max_seq_len_to_capture=64)
    'graph'
    >>> choose_path(num_prefills=1, num_seqs=3, max_seq_len=40, largest_size=8, max_seq_len_to_capture=64,
    ...             num_tokens=42, largest_piecewise_tokens=64)
    'piecewise'
    """
    if num_seqs < 1:
        raise ValueError("an empty batch has nothing to run")
    if largest_piecewise_tokens is not None and num_tokens is None:
        raise ValueError("choose_path with largest_piecewise_tokens needs the step's num_tokens")
    if num_prefills:
        reason = EAGER_PREFILL
    elif num_seqs > largest_size:
        reason = EAGER_OVERSIZE
    elif max_seq_len > max_seq_len_to_capture:
        reason = EAGER_OVERLONG
    else:
        return GRAPH
    if largest_piecewise_tokens is not None and num_tokens <= largest_piecewise_tokens:
        return PIECEWISE
    return reason

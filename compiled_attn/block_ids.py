"""A builder's block-id check across steps: a decode step that only extends the last one checks
only the blocks it adds.

`check_block_ids` marks every needed block of a step in a bitmap, one random byte write per
entry: 256 requests x 257 blocks cost ~0.11 ms of a 2-core machine, a third of `build()`'s
budget. In a decode loop each step reads the previous step's tables plus a block for the few
requests that crossed a block boundary, so a check that keeps the previous step's marks needs to
look at those new blocks only.
"""

from __future__ import annotations

import numpy as np

from compiled_attn.validation import check_block_ids


class BlockIdCheck:
    """`check_block_ids` for one builder's successive steps (a builder's `block_tables`).

    After a step whose requests named every block once, its padded table, its needs and its
    blocks' marks are kept. A next step with as many requests, each needing at least as many
    blocks, whose kept entries are unchanged, is checked by its new entries alone: in the cache,
    unmarked, and distinct. Anything else (another batch, a shorter need, an edited entry, a new
    entry that fails) goes through `check_block_ids` whole, which also words every error, so
    both paths accept and refuse the same steps with the same messages. The marks may name more
    blocks than the kept table reads (a rolling table's entry that left the window as block 0
    keeps block 0's mark), never fewer: an extra mark only sends a step to the whole check.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._marks = np.zeros(num_blocks, dtype=bool)  # the kept step's blocks
        self._kept: tuple[np.ndarray, np.ndarray] | None = None  # (padded table, need) of that step

    def __call__(self, table: np.ndarray, need: np.ndarray, ids: np.ndarray, row_ends: np.ndarray,
                 what: str) -> bool:
        """`check_block_ids(ids, row_ends, ...)` of a step whose padded table (`needed_table`,
        block 0 past each need, read-only from here on) and needs per request are given; returns
        whether a block is named more than once (prefix sharing: nothing kept then)."""
        if self._kept is not None and self._extend(table, need, ids, row_ends):
            return False
        self._forget()
        shared = check_block_ids(ids, row_ends, self.num_blocks, what, self._marks, keep_marks=True)
        if not shared:
            self._kept = (table, need)
        return shared

    def _extend(self, table: np.ndarray, need: np.ndarray, ids: np.ndarray, row_ends: np.ndarray) -> bool:
        """Whether `table` is the kept one plus new entries that pass; if so it is kept instead."""
        old, old_need = self._kept
        if table.shape[0] != old.shape[0] or bool((need < old_need).any()):
            return False
        # no need shrank, so the table is at least as wide; kept entries unchanged: a difference
        # may only sit where the kept table padded (past a need)
        width = old.shape[1]
        changed = np.flatnonzero(table[:, :width] != old)
        rows, cols = np.divmod(changed, width)
        if bool((cols < old_need[rows]).any()):
            return False
        # the new entries end each grown row's ids; read there, in the caller's dtype (the int32
        # table would have wrapped an id past int32 into range)
        grown = np.flatnonzero(need > old_need)
        ends, added = row_ends[grown], (need - old_need)[grown]
        # a rolling table's row may hold fewer ids than it added (np.diff's prepend costs 10x this)
        begins = row_ends[grown - 1] * (grown > 0)
        if bool((added > ends - begins).any()):
            return False
        fresh = ids[np.repeat(ends - np.cumsum(added), added) + np.arange(int(added.sum()))]
        if fresh.size:
            if int(fresh.min()) < 0 or int(fresh.max()) >= self.num_blocks:
                return False
            fresh = fresh.astype(np.intp)
            fresh_sorted = np.sort(fresh)  # a few dozen: np.unique's overhead is most of its cost
            if self._marks[fresh].any() or bool((fresh_sorted[1:] == fresh_sorted[:-1]).any()):
                return False
            self._marks[fresh] = True
        self._kept = (table, need)
        return True

    def _forget(self) -> None:
        if self._kept is not None:
            self._marks.fill(False)
            self._kept = None

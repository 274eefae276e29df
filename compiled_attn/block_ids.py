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
    blocks, every id in the cache and the kept entries unchanged, is checked by its new entries
    alone: unmarked and distinct. Anything else (another batch, a shorter need, an edited entry,
    an id out of range, a new entry that fails, a rolling table) goes through `check_block_ids`
    whole, which also words every error, so both paths accept and refuse the same steps with the
    same messages.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._marks = np.zeros(num_blocks, dtype=bool)  # the kept step's blocks
        self._kept: tuple[np.ndarray, np.ndarray] | None = None  # (padded table, need) of that step

    def __call__(self, table: np.ndarray, need: np.ndarray, ids: np.ndarray, row_ends: np.ndarray,
                 what: str, rolled: np.ndarray | None = None) -> bool:
        """`check_block_ids(ids, row_ends, ...)` of a step whose padded table (`needed_table`,
        block 0 past each need, read-only from here on) and needs per request are given; returns
        whether a block is named more than once (prefix sharing: nothing kept then). A rolling
        table's step (`rolled` not None) is checked whole and kept not: the window moves its
        first live entry both ways (a chunk starts earlier than the last decode)."""
        if self._kept is not None and self._extend(table, need, ids, row_ends):  # never kept if rolling
            return False
        self._forget()
        keep = rolled is None
        shared = check_block_ids(ids, row_ends, self.num_blocks, what, self._marks, keep_marks=keep)
        if keep and not shared:  # the marks are this step's
            self._kept = (table, need)
        return shared

    def _extend(self, table: np.ndarray, need: np.ndarray, ids: np.ndarray, row_ends: np.ndarray) -> bool:
        """Whether `table` is the kept one plus new entries that pass; if so it is kept instead."""
        old, old_need = self._kept
        if table.shape[0] != old.shape[0] or bool((need < old_need).any()):
            return False
        # every id in range, in the caller's dtype: then the int32 table holds each one exactly
        # (an int64 id 2**32 + 1 would read as block 1 there)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            return False
        # no need shrank, so the table is at least as wide; kept entries unchanged: a difference
        # may only sit where the kept table padded (past a need)
        width = old.shape[1]
        changed = np.flatnonzero(table[:, :width] != old)
        rows, cols = np.divmod(changed, width)
        if bool((cols < old_need[rows]).any()):
            return False
        # the new entries end each grown row's ids
        grown = np.flatnonzero(need > old_need)
        added = (need - old_need)[grown]
        fresh = ids[np.repeat(row_ends[grown] - np.cumsum(added), added) + np.arange(int(added.sum()))]
        if fresh.size:
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

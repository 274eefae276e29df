"""A minimal paged-KV bookkeeper: cache blocks per request, and one step's builder inputs.

Real servers have schedulers; this only hands out blocks and turns a batch of requests into
the (seq_lens, query_lens, block_tables) lists a builder takes, plus the model's ids/positions.
The demo, the soak driver, tests and benchmarks use it.
"""

from __future__ import annotations

import dataclasses

import torch


class BlockAllocator:
    """Hands out cache blocks from a free list; raises when the cache is full."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` until it holds `num_tokens` tokens."""
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self.free):
            raise RuntimeError(f"KV cache full: need {need} more blocks, {len(self.free)} free")
        for _ in range(need):
            table.append(self.free.pop())

    def release(self, table: list[int]) -> None:
        self.free.extend(reversed(table))
        table.clear()


@dataclasses.dataclass
class Request:
    tokens: list[int]  # every token so far (prompt + generated)
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = dataclasses.field(default_factory=list)


def schedule(requests: list[Request], allocator: BlockAllocator, device: torch.device | str):
    """One step over `requests` (prefills must come first): every uncomputed token is fed.

    Returns (seq_lens, query_lens, block_tables, input_ids [num_tokens], positions [num_tokens]).
    """
    seq_lens, query_lens, ids, pos = [], [], [], []
    for r in requests:
        n = len(r.tokens)
        allocator.grow(r.block_table, n)
        seq_lens.append(n)
        query_lens.append(n - r.num_computed)
        ids.extend(r.tokens[r.num_computed :])
        pos.extend(range(r.num_computed, n))
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    positions = torch.tensor(pos, dtype=torch.int64, device=device)
    return seq_lens, query_lens, [r.block_table for r in requests], input_ids, positions


def last_token_rows(query_lens: list[int]) -> list[int]:
    """Row of each request's last token in the flat batch (where its next-token logits are)."""
    rows, at = [], -1
    for q in query_lens:
        at += q
        rows.append(at)
    return rows

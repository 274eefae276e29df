"""Decode attention that reads the paged cache in place through FlexAttention (TORCH_SDPA's graphs
on CUDA: `backends.torch_sdpa.graph_decode_kernel`).

The cache [2, num_blocks, block_size, num_kv_heads, head_size] is viewed as one sequence of
num_blocks * block_size keys per KV head; a block mask lists each request's pages (its block-table
row) as the KV blocks it reads and cuts the last page at its length. Nothing is gathered or
copied, and nothing syncs: the mask is made of device tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Rows of queries per block-mask tile: a decode has one, the tile's other rows are empty. flex's
# decode kernel packs a KV head's G query heads into one tile of next_pow2(G) >= 16 rows and needs
# it to divide this: 128 serves every group up to 128.
Q_BLOCK = 128
# One compile per batch size (the runner's graphs: up to 35 sizes, made at their warm-ups).
# Dynamo's default of 8 would send the rest to flex's eager path, which materializes the scores
# over the whole pool; its limit over all frames is 256 by default.
RECOMPILE_LIMIT = 256


@functools.cache
def compiled_flex() -> Callable[..., torch.Tensor]:
    """Inductor's graph of flex: FlexAttention's decode kernel (eager flex computes full scores).
    dynamic=False keeps the batch static, which its decode kernel requires. Made at first use:
    making a torch.compile wrapper loads Dynamo and Inductor (seconds)."""
    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def paged_block_mask(tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int) -> BlockMask:
    """Each request's first ceil(seq_len / block_size) pages of `tables` (int32 [n, width]) as
    the KV blocks its query reads, the last one cut at seq_len (int32 [n]). flex's mask spans the
    whole pool in the KV dimension, so the table is zero-padded to num_blocks columns."""
    n, width = tables.shape
    used = (seq_lens + block_size - 1) // block_size
    last_page = tables.gather(1, (used - 1).long().view(n, 1)).view(n)
    end = seq_lens - (used - 1) * block_size
    indices = F.pad(tables, (0, num_blocks - width))

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx // block_size != last_page[b]) | (kv_idx % block_size < end[b])

    return BlockMask.from_kv_blocks(used.view(n, 1, 1), indices.view(n, 1, 1, num_blocks),
                                    BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
                                    seq_lengths=(1, num_blocks * block_size), compute_q_blocks=False)


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, mask: BlockMask, scale: float,
                 kernel_options: dict[str, Any] | None = None) -> torch.Tensor:
    """One query per request (query [n, num_heads, head_size]) over the pages `mask` lists;
    returns [n, num_heads, head_size]. `kernel_options`: flex's (num_warps, SPLIT_KV, ...)."""
    blocks, block_size, kv_heads, head_size = kv_cache.shape[1:]
    k, v = (kv_cache[i].view(1, blocks * block_size, kv_heads, head_size).transpose(1, 2) for i in (0, 1))
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT):
        out = compiled_flex()(query.unsqueeze(2), k, v, block_mask=mask, scale=scale, enable_gqa=True,
                                kernel_options=kernel_options)
    return out[:, :, 0]

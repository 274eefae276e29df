"""Decode attention that reads the paged cache in place through FlexAttention (TORCH_SDPA's graphs
on CUDA by default: `backends.torch_sdpa.graph_decode_kernel`).

The cache [2, num_blocks, block_size, num_kv_heads, head_size] is viewed as one sequence of
num_blocks * block_size keys per KV head; a block mask lists each request's full pages (its
block-table row) as the KV blocks FlexAttention reads. The last page is not among them: its slots
past the length hold whatever was there (a cache from torch.empty, a freed request's keys, NaN
included), and flex multiplies every value of a page it reads by its probability, so a NaN
there would reach the output through a zero weight. That page is copied per request and
attended separately, its unwritten values zeroed in the copy, and the two parts merge by their
log-sum-exps. Nothing of the cache is written, and nothing syncs: the mask is made of device
tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Rows of queries per block-mask tile: a decode has one, the tile's other rows are empty. flex's
# decode kernel packs a KV head's G query heads into one tile of next_pow2(G) >= 16 rows and needs
# it to divide this: 128 serves every group up to 128.
Q_BLOCK = 128
# One compile per batch size and cache shape (a runner's graphs: up to 35 sizes, made at their
# warm-ups), and a process keeps them all: one that builds runners for several models or caches
# (a test worker) can make hundreds. Dynamo's default of 8 would send the rest to eager flex, which
# ignores the block mask's page lists (it applies mask_mod densely: every key of the pool,
# garbage included), so a frame past the limit raises instead (fail_on_recompile_limit_hit).
# Both limits are per code object (`attend`'s): the default total of 256 is raised with them.
RECOMPILE_LIMIT = 1024


class PagedMask(NamedTuple):
    """A decode step's pages: `blocks` lists each request's full pages for FlexAttention; its
    last page (`last_page` [n]) holds `last_len` [n] keys, 1 .. block_size."""

    blocks: BlockMask
    last_page: torch.Tensor
    last_len: torch.Tensor


def paged_block_mask(tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int) -> PagedMask:
    """The pages of `tables` (int32 [n, width]) that hold each request's seq_len (int32 [n]) keys.
    flex's mask spans the whole pool in the KV dimension, so the table is zero-padded to
    num_blocks columns."""
    n, width = tables.shape
    full = (seq_lens - 1) // block_size
    last_page = tables.gather(1, full.long().view(n, 1)).view(n)
    indices = F.pad(tables, (0, num_blocks - width))
    blocks = BlockMask.from_kv_blocks(full.view(n, 1, 1), indices.view(n, 1, 1, num_blocks),
                                      BLOCK_SIZE=(Q_BLOCK, block_size), seq_lengths=(1, num_blocks * block_size),
                                      compute_q_blocks=False)
    return PagedMask(blocks, last_page, seq_lens - full * block_size)


def split_kv(batch: int, kv_heads: int, device: torch.device) -> int | None:
    """flex's SPLIT_KV for a decode of `batch` requests: at least min(8, 8 * SMs // (batch *
    kv_heads)) splits of each request's pages over CTAs, else flex's own choice (None: two per SM,
    one from batch * kv_heads >= SMs). Measured on an H100 at page 16 (`scripts/flex_paged_probe.py`):
    B=8 8 splits 20.0 us against flex's 4, 29.7; B=64 2 splits 102 us against 1, 133 (ctx 4096:
    382 against 505); B=256 flex's 1 best (384, 2 splits 390)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = min(8, 8 * sms // (batch * kv_heads))
    return want if want > max(1, sms // (batch * kv_heads) * 2) else None


def attend(query: torch.Tensor, kv_cache: torch.Tensor, mask: PagedMask, scale: float,
           kernel_options: dict[str, Any] | None) -> torch.Tensor:
    """What `paged_decode` compiles: flex over the full pages, plain attention over the last
    page's live keys, merged. query [n, H, D] -> [n, H, D]."""
    n, heads, head_size = query.shape
    blocks, block_size, kv_heads, _ = kv_cache.shape[1:]
    k, v = (kv_cache[i].view(1, blocks * block_size, kv_heads, head_size).transpose(1, 2) for i in (0, 1))
    out, lse = flex_attention(query.unsqueeze(2), k, v, block_mask=mask.blocks, scale=scale, enable_gqa=True,
                              return_lse=True, kernel_options=kernel_options)
    page_out, page_lse = last_page(query.view(n, kv_heads, heads // kv_heads, 1, head_size), kv_cache, mask, scale)
    # flex's lse is -inf for a request with no full page (its output 0): the weight goes to the page
    lse = lse.view(page_lse.shape)
    top = torch.maximum(lse, page_lse)
    w_flex, w_page = (lse - top).exp(), (page_lse - top).exp()
    merged = (out.view(page_out.shape).float() * w_flex.unsqueeze(-1)
              + page_out * w_page.unsqueeze(-1)) / (w_flex + w_page).unsqueeze(-1)
    return merged.view(n, heads, head_size).to(query.dtype)


def last_page(query: torch.Tensor, kv_cache: torch.Tensor, mask: PagedMask, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each request's G query heads per KV head (query [n, kv_heads, G, 1, D]) over
    the live keys of its last page, in fp32: (out [n, kv_heads, G, D], lse [n, kv_heads, G]).
    Products summed by broadcast, not einsum: Inductor makes them reductions fused with the
    page's gather and the masking (a page is a few dozen keys), where einsum's batched GEMMs
    were two cuBLAS kernels of 3-6 us each (H100 profile, `scripts/flex_paged_probe.py`)."""
    n, block_size = mask.last_len.shape[0], kv_cache.shape[2]
    live = (torch.arange(block_size, device=query.device) < mask.last_len.view(n, 1)).view(n, 1, 1, block_size)
    page_k, page_v = (kv_cache[i, mask.last_page].transpose(1, 2).float().unsqueeze(2) for i in (0, 1))
    scores = (query.float() * page_k).sum(-1).mul(scale).masked_fill(~live, -torch.inf)  # [n, kv_heads, G, page]
    lse = scores.logsumexp(-1)  # one live key at least: finite
    probs = (scores - lse.unsqueeze(-1)).exp()
    out = (probs.unsqueeze(-1) * page_v.masked_fill(~live.unsqueeze(-1), 0)).sum(-2)
    return out, lse


@functools.cache
def compiled_attend() -> Callable[..., torch.Tensor]:
    """Inductor's graph of `attend`: FlexAttention's decode kernel, which reads only the listed
    pages (eager flex applies mask_mod densely over the whole pool, and Inductor's CPU template
    returns no lse: CUDA only, `backends.torch_sdpa.FLEX_DEVICES`), and the last page's
    attention and merge fused. dynamic=False keeps the batch static, which flex's decode kernel
    requires. Made at first use: making a torch.compile wrapper loads Dynamo and Inductor
    (seconds)."""
    return torch.compile(attend, fullgraph=True, dynamic=False)


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, mask: PagedMask, scale: float,
                 kernel_options: dict[str, Any] | None = None) -> torch.Tensor:
    """One query per request (query [n, num_heads, head_size]) over the pages `mask` lists;
    returns [n, num_heads, head_size]. `kernel_options`: flex's (num_warps, SPLIT_KV, ...);
    SPLIT_KV defaults to `split_kv` on CUDA."""
    options = dict(kernel_options or {})
    if query.is_cuda and "SPLIT_KV" not in options:
        splits = split_kv(query.shape[0], kv_cache.shape[3], query.device)
        if splits:
            options["SPLIT_KV"] = splits
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT,
                                    fail_on_recompile_limit_hit=True):
        return compiled_attend()(query, kv_cache, mask, scale, options or None)

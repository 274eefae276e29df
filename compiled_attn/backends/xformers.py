"""XFORMERS: xFormers kernels with xFormers' own attention-bias classes, over the shared paged cache.

Which kernel serves what (xformers 0.0.35; measured in compiled_attn/bench/decode_xformers.py):

- decode (self and cross attention): triton split-K with `PagedBlockDiagonalCausalWithOffset-
  PaddedKeysMask` / `PagedBlockDiagonalPaddedKeysMask` straight over the cache, or the paged
  gappy mask for a sliding window (keys [seq_len - W, seq_len)). Any batch size; the op is named
  explicitly because xFormers' dispatcher drops split-K above 32 query tokens. That kernel needs
  block_size % 64 == 0, so the backend supports exactly those block sizes: anything else is a
  NotImplementedError (the gathered padded-keys alternative costs a full copy of every
  request's keys per layer; the bench measures it).
- prefill: flash (PyTorch's FA2), else cutlass, with `BlockDiagonalCausalMask` over this step's
  K/V when no prefill has cached context, else `BlockDiagonalCausalFromBottomRightMask` over
  K/V gathered from the cache (chunked prefill, prefix hits). Sliding windows use the local
  variants; ENCODER / ENCODER_ONLY / cross prefill use `BlockDiagonalMask`.
- ALiBi: a per-request dense tensor bias through cutlass (eager only).

Bias objects hold python ints, so they are built here — by the builder for eager steps, by the
State once per captured batch size (fixed maxima, device-side lengths) — never inside the op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from compiled_attn.abstract import AttentionBackend, AttentionSpec, AttentionType
from compiled_attn.backends.common import CommonImpl
from compiled_attn.graph_state import SCRATCH_BLOCK, GraphState
from compiled_attn.metadata import (
    CACHELESS_TYPES,
    CommonMetadata,
    CommonMetadataBuilder,
    DeviceField,
    HostStep,
    first_keys,
    prefix_sums,
    slots_for,
)
from compiled_attn.ops import xformers as _ops

NAME = "XFORMERS"
PAGE_MULTIPLE = 64  # triton split-K's BLOCK_N: a page must hold whole key tiles
HEAD_SIZES = (64, 128, 256)


class XFormersBackend(AttentionBackend):
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto",)
    supported_attn_types = tuple(AttentionType)
    supports_alibi = True
    supports_sliding_window = True
    supports_logits_soft_cap = False
    requires_cuda = True
    graph_attn_types = (AttentionType.DECODER, AttentionType.ENCODER_DECODER)  # cross decode too
    graph_supports_alibi = False  # ALiBi runs as a per-request tensor bias, eagerly
    package = "xformers"
    attention_op = torch.ops.compiled_attn.xformers_attention

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[XFormersImpl]:
        return XFormersImpl

    @staticmethod
    def get_metadata_cls() -> type[XFormersMetadata]:
        return XFormersMetadata

    @staticmethod
    def get_builder_cls() -> type[XFormersMetadataBuilder]:
        return XFormersMetadataBuilder

    @staticmethod
    def get_state_cls() -> type[XFormersState]:
        return XFormersState

    @classmethod
    def supported_head_sizes(cls) -> tuple[int, ...]:
        return HEAD_SIZES

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        """Paged decode runs on triton split-K, which reads whole 64-key tiles of a page."""
        return block_size % PAGE_MULTIPLE == 0


def check_block_size(block_size: int) -> None:
    """NotImplementedError for a block size the paged decode kernel cannot read."""
    if not XFormersBackend.supports_block_size(block_size):
        raise NotImplementedError(
            f"{NAME} supports block sizes that are multiples of {PAGE_MULTIPLE} (64, 128, 256, ...), "
            f"not {block_size}: xFormers' paged decode (triton split-K) reads whole 64-key tiles. "
            "Use FLASHINFER or TORCH_SDPA for other block sizes"
        )


@dataclasses.dataclass
class XFormersMetadata(CommonMetadata):
    """Common metadata plus xFormers' bias objects and the gathers they need.

    prefill_fresh:        True when no prefill has cached context: prefill attends over this
                          step's key/value directly, else over K/V gathered from the cache
    prefill_kv_slots:     int64, cache slots of every prefill's keys (only when not prefill_fresh;
                          a rolling table's: from the first key past its rolled blocks, `first_keys`)
    prefill_k_start:      int32 [num_prefills + 1], where each prefill's gathered keys start
                          (only when not prefill_fresh)
    decode_q_start:       int32 [num_decodes + 1], where each decode's query row starts among the
                          decodes (query_start_loc itself when the step has no prefills)
    decode_window_starts: int32 [num_decodes + 1], first key each decode sees (sliding window)
    alibi_kv_slots:       int64 cache slots of every request's keys, in request order, past rolled
                          blocks (ALiBi only; cross layers take no ALiBi, so encoder keys need none)
    biases:               role -> xFormers AttentionBias ("prefill", "decode", "cross_prefill",
                          "cross_decode", "encoder", "encoder_only")
    """

    prefill_fresh: bool = True
    # uploaded with the common fields, in the step's one copy (`add_backend_fields`)
    prefill_kv_slots: torch.Tensor | None = DeviceField(None)
    prefill_k_start: torch.Tensor | None = DeviceField(None)
    decode_q_start: torch.Tensor | None = DeviceField(None)
    decode_window_starts: torch.Tensor | None = DeviceField(None)
    alibi_kv_slots: torch.Tensor | None = DeviceField(None)
    biases: dict[str, Any] = dataclasses.field(default_factory=dict)

    def after_upload(self) -> None:
        if self.decode_q_start is None:  # no prefills: every query is a decode's one token
            self.decode_q_start = self.query_start_loc

    def bias(self, role: str) -> Any:
        """The bias object for `role`; ValueError when this metadata was built without its inputs."""
        if role not in self.biases:
            raise ValueError(
                f"{NAME} metadata has no {role!r} bias (it has {sorted(self.biases)}): build it with the "
                "inputs this attention type needs (encoder_seq_lens / cross_block_tables for cross attention)"
            )
        return self.biases[role]

    def check_options(self, sliding_window: int, has_alibi: bool) -> None:
        """The layer's options must match what the biases were planned with (the spec's)."""
        planned = self.spec.sliding_window or 0
        if sliding_window != planned:
            raise ValueError(
                f"{NAME}: the layer's sliding_window ({sliding_window or None}) differs from the spec's "
                f"({planned or None}) that the metadata's biases were built with"
            )
        if has_alibi != (self.spec.alibi_slopes is not None):
            raise ValueError(f"{NAME}: the layer's alibi_slopes and the spec's must both be set or both be None")


def seqinfo(seqstart: torch.Tensor, lens: list[int]) -> Any:
    """xFormers' `_SeqLenInfo` over an existing device prefix-sum tensor (no host->device copy)."""
    ab = _ops.fmha().attn_bias
    return ab._SeqLenInfo(
        seqstart=seqstart,
        max_seqlen=max(lens),
        min_seqlen=min(lens),
        seqstart_py=[0, *np.cumsum(lens).tolist()],
    )


def decode_bias(
    q_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    *,
    causal: bool,
    window_starts: torch.Tensor | None = None,
) -> Any:
    """The paged bias of `n` one-token queries over the cache, from device tensors only.

    q_start: int32 [n + 1] = 0..n; seq_lens: int32 [n] keys per request (its end position when
    `window_starts` is given); block_tables: int32 [n, max_blocks]; window_starts: int32 [n + 1]
    first visible key. The python ints inside depend on n and max_blocks only (never on the
    lengths), so a bias built at capture serves every replay.
    """
    ab = _ops.fmha().attn_bias
    n, max_blocks = block_tables.shape
    pad = max_blocks * block_size
    q_info = ab._SeqLenInfo(seqstart=q_start, max_seqlen=1, min_seqlen=1, seqstart_py=list(range(n + 1)))
    if window_starts is not None:
        k_info = ab._GappySeqInfo(
            seqstart=window_starts, max_seqlen=pad, min_seqlen=0, seqstart_py=[0] * n + [-1],
            seqlen=seq_lens, seqlen_py=[pad] * n,
        )
        return ab.PagedBlockDiagonalGappyKeysMask(
            q_seqinfo=q_info, k_seqinfo=k_info, block_tables=block_tables, page_size=block_size
        )
    k_info = ab._PaddedSeqLenInfo(
        seqstart=q_start, max_seqlen=pad, min_seqlen=0, seqstart_py=list(range(0, (n + 1) * pad, pad)),
        seqlen=seq_lens, seqlen_py=[pad] * n, padding=pad,
    )  # seqstart is never read for paged keys (pages are found through block_tables)
    cls = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask if causal else ab.PagedBlockDiagonalPaddedKeysMask
    return cls(q_seqinfo=q_info, k_seqinfo=k_info, block_tables=block_tables, page_size=block_size)


def window_starts(seq_lens: np.ndarray, sliding_window: int) -> np.ndarray:
    """The first key each decode of `seq_lens` tokens sees through a window of `sliding_window`."""
    return np.maximum(seq_lens - sliding_window, 0)


class XFormersMetadataBuilder(CommonMetadataBuilder):
    """Common builder + the gathers and bias objects of one step (all host work happens here)."""

    metadata_cls = XFormersMetadata
    backend_cls = XFormersBackend

    def __init__(self, spec: AttentionSpec, *, rolling_tables: bool = False) -> None:
        if isinstance(spec, AttentionSpec):  # anything else gets the builder's own error
            check_block_size(spec.block_size)  # the message that says why, before the builder's generic one
        super().__init__(spec, rolling_tables=rolling_tables)

    def build(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        encoder_seq_lens: list[int] | None = None,
        cross_block_tables: list[list[int]] | None = None,
    ) -> XFormersMetadata:
        md = super().build(seq_lens, query_lens, block_tables, encoder_seq_lens, cross_block_tables)
        md.upload_pending()  # now, not at a first read: the bias objects below hold the device fields
        md.biases = build_biases(md)
        return md

    def add_backend_fields(self, step: HostStep) -> dict[str, Any]:
        """The gathers xFormers' kernels need beyond the common fields, uploaded in the step's one
        copy with them (none for a decode-only step without a window or ALiBi)."""
        spec, p, bs = self.spec, step.num_prefills, self.spec.block_size
        seq_lens, block_table = step.seq_lens, step.block_table
        uses_cache = spec.attn_type not in CACHELESS_TYPES
        pre_seq, pre_q = seq_lens[:p], step.query_lens[:p]
        fresh = all(s == q for s, q in zip(pre_seq, pre_q, strict=True))
        fields: dict[str, Any] = {"prefill_fresh": fresh}
        # gathers start past a rolling table's freed blocks: no query sees them, and their entries
        # read block 0, whose contents the window mask would meet (NaN there reached the output)
        first = first_keys(step.rolled_blocks, len(seq_lens), bs)
        if p:  # without prefills every query is a decode's one token: query_start_loc is 0..n already
            fields["decode_q_start"] = np.arange(len(seq_lens) - p + 1, dtype=np.int32)
        if not fresh:
            fields["prefill_k_start"] = prefix_sums(np.asarray(pre_seq) - first[:p])
            if uses_cache:
                fields["prefill_kv_slots"] = slots_for(block_table[:p], first[:p], pre_seq, bs)
        if spec.sliding_window and len(seq_lens) > p:
            starts = window_starts(np.asarray(seq_lens[p:], dtype=np.int64), spec.sliding_window)
            fields["decode_window_starts"] = np.append(starts, 0).astype(np.int32)
        if spec.alibi_slopes is not None and uses_cache:
            fields["alibi_kv_slots"] = slots_for(block_table, first, seq_lens, bs)
        return fields


def build_biases(md: XFormersMetadata) -> dict[str, Any]:
    """Every bias this step's metadata can serve, keyed by role (cheap: no host->device copies)."""
    ab = _ops.fmha().attn_bias
    spec, p, window = md.spec, md.num_prefills, md.spec.sliding_window
    uses_cache = spec.attn_type not in CACHELESS_TYPES
    out: dict[str, Any] = {}
    q_info = seqinfo(md.query_start_loc[: p + 1], md.query_lens[:p]) if p else None
    if p and uses_cache:
        if md.prefill_fresh:
            bias = ab.BlockDiagonalCausalMask(q_seqinfo=q_info, k_seqinfo=q_info)
            out["prefill"] = bias.make_local_attention(window) if window else bias
        else:
            first = first_keys(md.rolled_blocks, md.num_seqs, md.block_size)[:p]
            k_info = seqinfo(md.prefill_k_start, (np.asarray(md.seq_lens[:p]) - first).tolist())
            if window:
                bias = ab.BlockDiagonalMask(q_seqinfo=q_info, k_seqinfo=k_info)
                out["prefill"] = bias.make_local_attention_from_bottomright(window)
            else:
                out["prefill"] = ab.BlockDiagonalCausalFromBottomRightMask(q_seqinfo=q_info, k_seqinfo=k_info)
    if md.num_decodes and uses_cache:
        out["decode"] = decode_bias(
            md.decode_q_start, md.seq_lens_tensor[p:], md.block_tables[p:], md.block_size,
            causal=True, window_starts=md.decode_window_starts,
        )
    if md.num_decodes == 0:
        all_q = seqinfo(md.query_start_loc, md.query_lens)
        out["encoder_only"] = ab.BlockDiagonalMask(q_seqinfo=all_q, k_seqinfo=all_q)
    if md.encoder_seq_lens is not None:
        enc = md.encoder_seq_lens
        enc_info = seqinfo(md.encoder_seq_start_loc, enc)
        out["encoder"] = ab.BlockDiagonalMask(q_seqinfo=enc_info, k_seqinfo=enc_info)
        if md.cross_block_tables is not None:
            if p:
                pre_enc = seqinfo(md.encoder_seq_start_loc[: p + 1], enc[:p])
                out["cross_prefill"] = ab.BlockDiagonalMask(q_seqinfo=q_info, k_seqinfo=pre_enc)
            if md.num_decodes:
                out["cross_decode"] = decode_bias(
                    md.decode_q_start, md.encoder_seq_lens_tensor[p:], md.cross_block_tables[p:],
                    md.block_size, causal=False,
                )
    return out


class XFormersImpl(CommonImpl):
    """CommonImpl's forward (cache write, then one `compiled_attn::xformers_attention` call)."""

    backend_cls = XFormersBackend

    def check_matches_metadata(self, x, kv_cache, md, attn_type) -> None:
        super().check_matches_metadata(x, kv_cache, md, attn_type)
        md.check_options(self.sliding_window or 0, self.alibi_slopes is not None)


class XFormersState(GraphState):
    """GraphState plus the inputs of the window and cross-attention biases, and one paged bias per
    captured batch size (in its metadata):

        decode_window_starts:    int32 [max_batch_size + 1], first key each decode sees; pads 0
                                 (sliding-window specs)
        encoder_seq_lens_tensor: int32 [max_batch_size]; pads 1 (ENCODER_DECODER specs)
        cross_block_tables:      int32 [max_batch_size, W]; pads SCRATCH_BLOCK (ENCODER_DECODER specs)

    The biases' python ints depend only on the batch size and the block-table width W, so there
    is nothing to plan: replay reads the lengths and tables from the buffers.
    """

    backend_cls = XFormersBackend
    ROW_PADS = {**GraphState.ROW_PADS, "decode_window_starts": 0, "encoder_seq_lens_tensor": 1}
    TABLES = (*GraphState.TABLES, "cross_block_tables")

    def allocate_extra(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        dev, n, i32 = self.spec.device, max_batch_size, torch.int32
        out = {}
        if self.spec.sliding_window:
            out["decode_window_starts"] = torch.zeros(n + 1, dtype=i32, device=dev)
        if self.spec.attn_type == AttentionType.ENCODER_DECODER:
            out["encoder_seq_lens_tensor"] = torch.ones(n, dtype=i32, device=dev)
            out["cross_block_tables"] = torch.full((n, self.max_blocks_per_seq), SCRATCH_BLOCK, dtype=i32, device=dev)
        return out

    def host_rows(self, md: XFormersMetadata) -> dict[str, np.ndarray]:
        rows = super().host_rows(md)
        if "decode_window_starts" in self._buffers:
            rows["decode_window_starts"] = window_starts(rows["seq_lens_tensor"], self.spec.sliding_window)
        if "encoder_seq_lens_tensor" in self._buffers:
            rows["encoder_seq_lens_tensor"] = np.asarray(md.encoder_seq_lens, dtype=np.int64)
        return rows

    def add_graph_fields(self, md: XFormersMetadata, batch_size: int) -> None:
        b, n = self._buffers, batch_size
        md.decode_q_start = md.query_start_loc
        if "decode_window_starts" in b:
            md.decode_window_starts = b["decode_window_starts"][: n + 1]
        md.biases = {"decode": decode_bias(md.decode_q_start, md.seq_lens_tensor, md.block_tables, md.block_size,
                                           causal=True, window_starts=md.decode_window_starts)}
        if "cross_block_tables" in b:
            md.encoder_seq_lens = [1] * n
            md.max_encoder_seq_len = 1
            md.encoder_seq_lens_tensor = b["encoder_seq_lens_tensor"][:n]
            md.cross_block_tables = b["cross_block_tables"][:n]
            # a decode step has no prefill, so no encoder token to write (what the layers' checks read)
            md.cross_slot_mapping = torch.empty(0, dtype=torch.int64, device=self.spec.device)
            md.biases["cross_decode"] = decode_bias(md.decode_q_start, md.encoder_seq_lens_tensor,
                                                    md.cross_block_tables, md.block_size, causal=False)

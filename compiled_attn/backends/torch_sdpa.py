"""TORCH_SDPA: paged attention from plain torch ops, on CPU and CUDA (the reference backend).

Its op (`ops/torch_sdpa.py`) gathers requests into padded batches; the builder precomputes the
padded layout on the host so the op needs no `.tolist()` or device syncs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from compiled_attn.abstract import (
    AttentionBackend,
    AttentionSpec,
    AttentionState,
    AttentionType,
)
from compiled_attn.backends.common import CommonImpl
from compiled_attn.metadata import CommonMetadata, CommonMetadataBuilder, check_graph_step, to_device
from compiled_attn.ops import torch_sdpa as _ops  # noqa: F401  (registers the op)
from compiled_attn.validation import as_int

NAME = "TORCH_SDPA"


class TorchSDPABackend(AttentionBackend):
    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto",)
    supported_attn_types = tuple(AttentionType)
    supports_alibi = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    requires_cuda = False

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[TorchSDPAImpl]:
        return TorchSDPAImpl

    @staticmethod
    def get_metadata_cls() -> type[TorchSDPAMetadata]:
        return TorchSDPAMetadata

    @staticmethod
    def get_builder_cls() -> type[TorchSDPAMetadataBuilder]:
        return TorchSDPAMetadataBuilder

    @staticmethod
    def get_state_cls() -> type[TorchSDPAState]:
        return TorchSDPAState


@dataclasses.dataclass
class TorchSDPAMetadata(CommonMetadata):
    """Common metadata plus the padded layout of the prefill (and encoder) tokens.

    prefill_token_index: int64 [num_prefills, max_prefill_query_len], row of each padded query
        (pads repeat the request's first token, so every gathered row is a real one)
    prefill_q_pos:       int64 [num_prefills, max_prefill_query_len], position in the sequence
        (pads get 0: they see one valid key, which keeps their discarded outputs finite)
    prefill_flat_index:  int64 [num_prefill_tokens], where each token sits in the padded batch
    encoder_*:           the same for the encoder tokens (ENCODER attention)
    """

    prefill_token_index: torch.Tensor | None = None
    prefill_q_pos: torch.Tensor | None = None
    prefill_flat_index: torch.Tensor | None = None
    encoder_token_index: torch.Tensor | None = None
    encoder_q_pos: torch.Tensor | None = None
    encoder_flat_index: torch.Tensor | None = None


def padded_layout(lens: list[int], firsts: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token index [B, L], query position [B, L] and flat index for requests of `lens` new
    tokens starting at sequence positions `firsts`."""
    width = max(lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    col = np.arange(width, dtype=np.int64)
    lens_a = np.asarray(lens, dtype=np.int64)[:, None]
    real = col[None, :] < lens_a
    token_index = np.where(real, starts[:, None] + col[None, :], starts[:, None])
    q_pos = np.where(real, np.asarray(firsts, dtype=np.int64)[:, None] + col[None, :], 0)
    flat_index = (np.arange(len(lens))[:, None] * width + col[None, :])[real]
    return token_index, q_pos, flat_index


class TorchSDPAMetadataBuilder(CommonMetadataBuilder):
    metadata_cls = TorchSDPAMetadata
    backend_name = NAME

    def add_backend_fields(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        num_prefills: int,
        encoder_seq_lens: list[int] | None,
    ) -> dict[str, Any]:
        groups = {}
        if num_prefills:
            firsts = [s - q for s, q in zip(seq_lens[:num_prefills], query_lens[:num_prefills], strict=True)]
            groups["prefill"] = padded_layout(query_lens[:num_prefills], firsts)
        if encoder_seq_lens is not None:
            groups["encoder"] = padded_layout(encoder_seq_lens, [0] * len(encoder_seq_lens))
        out = {}
        for group, arrays in groups.items():
            names = (f"{group}_token_index", f"{group}_q_pos", f"{group}_flat_index")
            for name, a in zip(names, arrays, strict=True):
                out[name] = to_device(np.ascontiguousarray(a), self.device)
        return out


class TorchSDPAImpl(CommonImpl):
    backend_cls = TorchSDPABackend

    def attention(self, query, key, value, kv_cache, output, layer_name):
        torch.ops.compiled_attn.torch_sdpa_attention(query, key, value, kv_cache, output, layer_name)


class TorchSDPAState(AttentionState):
    """Static decode buffers for CUDA-graph capture; the op reads them at replay.

    The op gathers each request's keys through its block-table row and masks them by seq_len,
    so a graph needs only device buffers, no host planning (`begin_forward` does nothing):

        block_tables:      int32 [max_batch_size, ceil(max_seq_len_to_capture / block_size)]
        seq_lens_tensor:   int32 [max_batch_size]
        context_lens_tensor: int32 [max_batch_size]
        slot_mapping:      int64 [max_batch_size]
        query_start_loc:   int32 [max_batch_size + 1], always arange (one token per decode)

    Pad rows (n..bs-1 of a batch of n live decodes) write nothing (slot -1) and read one token
    of block 0 (seq_len 1): a valid index whatever the cache holds; their outputs are discarded.
    Cost: the decode gathers every row's full table, so a step moves
    bs * max_seq_len_to_capture keys per layer whatever the live lengths: keep
    `spec.max_seq_len_to_capture` near the longest sequence served.

    Example (see DESIGN.md for the full call order)::

        state = TorchSDPABackend.get_state_cls()(spec)
        with state.graph_capture(max_batch_size=8):
            md_bs = state.graph_capture_get_metadata_for_batch(8)
            bufs = state.get_graph_input_buffers(md_bs)
            graph_state = state.graph_clone(8)
            ...  # warm up, capture the step under set_forward_context(md_bs)
        graph_state.prepare_graph_input_buffers(bufs, md)  # md: decode-only, <= 8 requests
        graph_state.begin_forward(md)
        graph.replay()
    """

    def __init__(self, spec: AttentionSpec, buffers: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(spec)
        self._buffers = buffers  # full-size static buffers, shared by every clone
        self._capturing = False
        self.max_blocks_per_seq = -(-spec.max_seq_len_to_capture // spec.block_size)

    @contextmanager
    def graph_capture(self, max_batch_size: int) -> Iterator[None]:
        """Allocate the static buffers for up to `max_batch_size` decodes (once; reused if big enough)."""
        if self.spec.attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"{NAME} captures DECODER decode steps only, not {self.spec.attn_type.name}; run those eagerly"
            )
        max_batch_size = as_int("max_batch_size", max_batch_size)
        if self.spec.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{NAME}: allocate the graph state (graph_capture) before capturing, not inside")
        if self._buffers is None or self._buffers["seq_lens_tensor"].shape[0] < max_batch_size:
            self._buffers = self._allocate(max_batch_size)
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def _allocate(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        dev, n, i32 = self.spec.device, max_batch_size, torch.int32
        return {
            "slot_mapping": torch.full((n,), -1, dtype=torch.int64, device=dev),
            "seq_lens_tensor": torch.ones(n, dtype=i32, device=dev),
            "context_lens_tensor": torch.zeros(n, dtype=i32, device=dev),
            "query_start_loc": torch.arange(n + 1, dtype=i32, device=dev),
            "block_tables": torch.zeros(n, self.max_blocks_per_seq, dtype=i32, device=dev),
        }

    def graph_capture_get_metadata_for_batch(self, batch_size: int) -> TorchSDPAMetadata:
        """All-pad decode metadata of `batch_size` rows whose tensors are views of the static buffers."""
        if not self._capturing or self._buffers is None:
            raise RuntimeError(
                "call graph_capture_get_metadata_for_batch inside `with state.graph_capture(max_batch_size):`"
            )
        b, n = self._buffers, as_int("batch_size", batch_size, minimum=None)
        if not 1 <= n <= b["seq_lens_tensor"].shape[0]:
            raise ValueError(f"batch_size={n} outside 1..{b['seq_lens_tensor'].shape[0]} (graph_capture's maximum)")
        fill_pads(b, 0, n)  # warm-up and capture run on these rows: they must write nothing
        spec = self.spec
        # Host fields are fixed per batch size (the op reads num_prefills = 0 and num_decodes = n);
        # the per-step lengths live in the device views only.
        return TorchSDPAMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=n, slot_mapping=b["slot_mapping"][:n],
            seq_lens=[1] * n, query_lens=[1] * n, block_tables_list=[[0]] * n, max_query_len=1,
            max_seq_len=spec.max_seq_len_to_capture, seq_lens_tensor=b["seq_lens_tensor"][:n],
            context_lens_tensor=b["context_lens_tensor"][:n], query_start_loc=b["query_start_loc"][: n + 1],
            block_tables=b["block_tables"][:n], backend_name=NAME, block_size=spec.block_size,
            num_blocks=spec.num_blocks, spec=spec,
        )

    def graph_clone(self, batch_size: int) -> TorchSDPAState:
        """A state for the graph of `batch_size`: shares the static buffers (keeping them alive)."""
        if self._buffers is None:
            raise RuntimeError(f"graph_clone({batch_size}) before graph_capture allocated the buffers")
        return TorchSDPAState(self.spec, self._buffers)  # the buffers are all a size's graph reads

    def get_graph_input_buffers(self, attn_metadata: TorchSDPAMetadata) -> dict[str, torch.Tensor]:
        """The static views `attn_metadata` (from graph_capture_get_metadata_for_batch) is made of."""
        md = attn_metadata
        return {name: getattr(md, name) for name in GRAPH_INPUTS}

    def prepare_graph_input_buffers(
        self, input_buffers: dict[str, torch.Tensor], attn_metadata: TorchSDPAMetadata
    ) -> None:
        """Copy a decode-only step of n <= bs requests into the buffers of size bs; rows n.. become pads.

        Device-to-device copies on the current stream (ordered before the replay), no sync.
        ValueError for a step the graph cannot serve: prefills, n > bs, a sequence longer than
        spec.max_seq_len_to_capture, metadata of another backend or device.
        """
        md, bufs = attn_metadata, input_buffers
        bs = bufs["slot_mapping"].shape[0]
        self._check_step(md, bs, bufs["block_tables"])
        n, width = md.num_seqs, md.block_tables.shape[1]
        bufs["slot_mapping"][:n].copy_(md.slot_mapping, non_blocking=True)
        bufs["seq_lens_tensor"][:n].copy_(md.seq_lens_tensor, non_blocking=True)
        bufs["context_lens_tensor"][:n].copy_(md.context_lens_tensor, non_blocking=True)
        bufs["query_start_loc"][: n + 1].copy_(md.query_start_loc, non_blocking=True)
        # Columns past a live row's width keep block ids of earlier steps (or 0): valid indices
        # for the gather, and the op masks every key beyond seq_len, so they never reach an output.
        bufs["block_tables"][:n, :width].copy_(md.block_tables, non_blocking=True)
        fill_pads(bufs, n, bs)

    def _check_step(self, md: TorchSDPAMetadata, bs: int, tables: torch.Tensor) -> None:
        check_graph_step(md, self.spec, NAME, bs, tables.device)
        if not isinstance(md, TorchSDPAMetadata) or md.block_tables.shape[1] > tables.shape[1]:
            raise ValueError(f"{NAME} graphs replay metadata from {NAME}'s builder for this spec")

    def begin_forward(self, attn_metadata: TorchSDPAMetadata) -> None:
        """Nothing to plan: the op reads lengths and tables from the static buffers at replay."""


GRAPH_INPUTS = ("slot_mapping", "seq_lens_tensor", "context_lens_tensor", "query_start_loc", "block_tables")


def fill_pads(bufs: dict[str, torch.Tensor], lo: int, hi: int) -> None:
    """Rows lo..hi-1 become pads: no cache write (slot -1), one key of block 0 read (any block is
    valid to read; the output is discarded). query_start_loc stays arange: a pad is one token."""
    if lo >= hi:
        return
    bufs["slot_mapping"][lo:hi].fill_(-1)
    bufs["seq_lens_tensor"][lo:hi].fill_(1)
    bufs["context_lens_tensor"][lo:hi].zero_()
    bufs["block_tables"][lo:hi].zero_()

"""TORCH_SDPA: paged attention from plain torch ops, on CPU and CUDA (the reference backend).

Its op (`ops/torch_sdpa.py`) gathers requests into padded batches; the builder precomputes the
padded layout on the host so the op needs no `.tolist()` or device syncs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch

from compiled_attn.abstract import AttentionBackend, AttentionSpec, AttentionType
from compiled_attn.backends.common import CommonImpl
from compiled_attn.graph_state import GraphState
from compiled_attn.metadata import CommonMetadata, CommonMetadataBuilder, DeviceField, HostStep
from compiled_attn.ops import torch_sdpa as _ops  # noqa: F401  (registers the op)

NAME = "TORCH_SDPA"


class TorchSDPABackend(AttentionBackend):
    supported_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto",)
    supported_attn_types = tuple(AttentionType)
    supports_alibi = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    requires_cuda = False
    graph_attn_types = (AttentionType.DECODER,)
    graph_supports_alibi = True
    attention_op = torch.ops.compiled_attn.torch_sdpa_attention

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
        (pads get 0; their outputs are discarded: finite where key 0 is valid, NaN where a
        rolling table left it behind the window)
    prefill_flat_index:  int64 [num_prefill_tokens], where each token sits in the padded batch
    encoder_*:           the same for the encoder tokens (ENCODER attention)
    """

    prefill_token_index: torch.Tensor | None = DeviceField(None)
    prefill_q_pos: torch.Tensor | None = DeviceField(None)
    prefill_flat_index: torch.Tensor | None = DeviceField(None)
    encoder_token_index: torch.Tensor | None = DeviceField(None)
    encoder_q_pos: torch.Tensor | None = DeviceField(None)
    encoder_flat_index: torch.Tensor | None = DeviceField(None)
    flex_decode: bool = False  # graph metadata of a State on FlexAttention (`graph_decode_kernel`)


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
    backend_cls = TorchSDPABackend

    def add_backend_fields(self, step: HostStep) -> dict[str, Any]:
        groups = {}
        p, enc = step.num_prefills, step.encoder_seq_lens
        if p:
            firsts = [s - q for s, q in zip(step.seq_lens[:p], step.query_lens[:p], strict=True)]
            groups["prefill"] = padded_layout(step.query_lens[:p], firsts)
        if enc is not None:
            groups["encoder"] = padded_layout(enc, [0] * len(enc))
        out = {}
        for group, arrays in groups.items():
            names = (f"{group}_token_index", f"{group}_q_pos", f"{group}_flat_index")
            for name, a in zip(names, arrays, strict=True):
                out[name] = a  # int64, to the device with the step's common fields
        return out


# "auto" (default), "flex" or "gather": the decode kernel of TORCH_SDPA's graphs (`graph_decode_kernel`).
GRAPH_DECODE_ENV = "COMPILED_ATTN_SDPA_GRAPH_DECODE"


# Where FlexAttention's paged decode runs: on CPU, Inductor's C++ flex template (torch 2.13)
# returns no log-sum-exp, and eager flex ignores the block mask's page lists.
FLEX_DEVICES = ("cuda",)


def flex_decode_reason(spec: AttentionSpec) -> str | None:
    """Why FlexAttention's paged decode (`ops/flex_decode.py`) cannot serve `spec`'s graphs, or None."""
    group = spec.num_heads // spec.num_kv_heads
    if torch.device(spec.device).type not in FLEX_DEVICES:
        return f"FlexAttention's paged decode runs on {', '.join(FLEX_DEVICES)} only"
    if spec.alibi_slopes is not None or spec.logits_soft_cap is not None or spec.sliding_window is not None:
        return "FlexAttention's paged decode takes no ALiBi, soft-cap or window here"
    if group & (group - 1) or group > 128:
        return f"FlexAttention's decode kernel needs a power-of-two GQA group up to 128, not {group}"
    if spec.block_size < 16 or spec.block_size & (spec.block_size - 1):
        return f"FlexAttention's decode kernel reads pages of a power of two >= 16 tokens, not {spec.block_size}"
    return None


def graph_decode_kernel(spec: AttentionSpec, choice: str | None = None) -> str:
    """The decode of `spec`'s graphs: "flex" (FlexAttention reading the pages in place) or
    "gather" (each row's table gathered into contiguous K/V, then eager's SDPA). `choice`
    (default: the GRAPH_DECODE_ENV variable, else "auto") picks flex wherever
    `flex_decode_reason` allows ("auto"), always ("flex": NotImplementedError where it cannot)
    or never ("gather"). flex is the faster in the decode loop (BENCHMARKS.md); it is another
    kernel than eager's SDPA, so its greedy tokens differ from eager's at bf16 near-ties, as
    FlashInfer's do (`compiled_attn/testing/agreement.py`)."""
    choice = choice or os.environ.get(GRAPH_DECODE_ENV) or "auto"
    if choice not in ("gather", "flex", "auto"):
        raise ValueError(f"{GRAPH_DECODE_ENV}={choice!r}: use gather, flex or auto")
    if choice == "gather":
        return choice
    reason = flex_decode_reason(spec)
    if reason is not None and choice == "flex":
        raise NotImplementedError(f"{GRAPH_DECODE_ENV}=flex: {reason}")
    return "gather" if reason else "flex"


class TorchSDPAImpl(CommonImpl):
    backend_cls = TorchSDPABackend

    def check_matches_metadata(self, x, kv_cache, md, attn_type) -> None:
        # Each layer uses its own options, but rolling tables hold only the blocks the spec's
        # window sees: a layer seeing further back would read freed blocks (block 0's contents).
        super().check_matches_metadata(x, kv_cache, md, attn_type)
        window = md.spec.sliding_window
        if md.rolled_blocks is not None and attn_type == AttentionType.DECODER and (
                self.sliding_window is None or self.sliding_window > window):
            raise ValueError(f"TORCH_SDPA: the layer's sliding_window ({self.sliding_window}) sees keys that this "
                             f"step's rolling tables have freed (rolled by the spec's window, {window}): give the "
                             "layer a window <= the spec's, or build its metadata without rolling_tables")


class TorchSDPAState(GraphState):
    """GraphState over the common buffers only: the op gathers each request's keys through its
    block-table row and masks them by seq_len, so a graph needs no host planning
    (`begin_forward` only checks the call order).

    With `graph_decode_kernel` "flex" (the default on CUDA), the graphs' decode reads the pages
    in place through FlexAttention, whose work follows the live lengths: one table width per size. Its
    layers with their own window, soft-cap or ALiBi gather, at that one width.

    With "gather" (CPU, specs flex cannot serve, or asked for), the decode gathers every row's whole table
    (`md.block_tables.shape[1]` blocks), so a graph's step moves bs * width * block_size keys per
    layer whatever the live lengths.
    Hence graphs of several table widths per batch size (MIN_TABLE_WIDTH_TOKENS): 256 tokens'
    worth of blocks, doubling up to W = ceil(max_seq_len_to_capture / block_size), and W itself;
    the runner replays the narrowest that holds the step's longest sequence, so a step reads at
    most twice the keys of its longest table (eager pads every row to that one too), or 256 per
    row. For block sizes dividing 256 that is 1 + ceil(log2(max_seq_len_to_capture / 256))
    widths: 3 at 1024 tokens, 6 at the default 8192.
    """

    backend_cls = TorchSDPABackend
    # The floor bounds the count (each width is one more graph per capture size: capture time and
    # pool); steps of shorter sequences gather 256 keys per row. Chosen, not tuned on a GPU.
    MIN_TABLE_WIDTH_TOKENS = 256

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.decode_kernel = graph_decode_kernel(spec)
        self.decodes_on_eager_kernel = self.decode_kernel == "gather"
        if self.decode_kernel == "flex":
            self.MIN_TABLE_WIDTH_TOKENS = None

    def add_graph_fields(self, md: TorchSDPAMetadata, batch_size: int) -> None:
        md.flex_decode = self.decode_kernel == "flex"

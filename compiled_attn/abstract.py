"""The contract every backend implements: attention types, the layer-group spec and five classes.

A backend is a set of five classes behind one static factory (`AttentionBackend`):

- `AttentionMetadata`: what one step needs on the device (slot mapping, block tables, lengths),
  with prefill / decode views; built on the host by
- `AttentionMetadataBuilder`, from python lists of lengths and block tables;
- `AttentionImpl`: the forward, which launches this backend's custom ops;
- `AttentionState`: static buffers and per-batch-size planning for CUDA-graph capture and replay
  (implemented once, by `graph_state.GraphState`, which each backend extends with hooks).

`AttentionType`, the KV-cache dtypes and `AttentionMetadata` are defined in `base` (which
`validation` can import without importing this module) and re-exported here. docs/design.md
describes the whole contract.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from compiled_attn.base import AttentionMetadata, AttentionType, kv_cache_torch_dtype
from compiled_attn.capabilities import cuda_unavailable_reason, spec_unsupported_reason
from compiled_attn.validation import as_int, check_block_op_args, check_device_available, check_spec


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class AttentionSpec:
    """What a group of layers that share one cache layout and one planning has in common.

    One spec per group (e.g. all decoder layers of a model). The builder, the state and the
    impls of the group are made from it; per-step planning (FlashInfer) bakes in scale, window,
    soft-cap, ALiBi and causality, so an impl whose values differ is rejected.

    Example::

        spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                             num_blocks=4096, dtype=torch.bfloat16, device="cuda")
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype = torch.bfloat16
    device: str | torch.device = "cuda"
    kv_cache_dtype: str = "auto"  # "auto" (= dtype) | "fp8" (= "fp8_e4m3") | "fp8_e4m3" | "fp8_e5m2"
    scale: float | None = None  # None means head_size ** -0.5
    sliding_window: int | None = None  # W: a query sees the W most recent keys, itself included
    logits_soft_cap: float | None = None  # c: scores become c * tanh(scores / c)
    alibi_slopes: torch.Tensor | None = None  # float [num_heads]
    attn_type: AttentionType = AttentionType.DECODER
    max_seq_len_to_capture: int = 8192  # the longest sequence a captured decode graph serves

    def __post_init__(self) -> None:
        for name, value in check_spec(self).items():  # ValueError naming the field, whatever its type
            object.__setattr__(self, name, value)

    @property
    def softmax_scale(self) -> float:
        return self.head_size**-0.5 if self.scale is None else float(self.scale)

    @property
    def cache_dtype(self) -> torch.dtype:
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)


class AttentionBackend(ABC):
    """Static factory of one backend: its classes, its KV-cache shape and block copies.

    Capabilities are small class attributes / classmethods: `capabilities.capability_reason`
    checks a need against them, explaining why a backend cannot serve a spec, and
    `registry.backends_with` names the backends that can.
    """

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]]
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]]
    supported_attn_types: ClassVar[tuple[AttentionType, ...]]
    supports_alibi: ClassVar[bool]
    supports_sliding_window: ClassVar[bool]
    supports_logits_soft_cap: ClassVar[bool]
    # both on one layer (a backend may have each alone: FlashInfer adds ALiBi inside the cap)
    supports_alibi_with_soft_cap: ClassVar[bool] = True
    requires_cuda: ClassVar[bool]
    # What the State (`get_state_cls`) captures in CUDA graphs: decode steps of specs of these types,
    # and whether of ALiBi specs. `graph_state.GraphState.graph_capture` refuses the others.
    graph_attn_types: ClassVar[tuple[AttentionType, ...]]
    graph_supports_alibi: ClassVar[bool]
    package: ClassVar[str | None] = None  # the pip package a CUDA-only backend needs
    # The backend's attention op, `torch.ops.compiled_attn.<backend>_attention` (one signature for
    # all: `ops.library.define_attention_op`); every Impl's traced path calls it.
    attention_op: ClassVar[Any]

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """The registry name, e.g. "TORCH_SDPA"."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """The class whose `forward` runs attention."""

    @staticmethod
    @abstractmethod
    def get_metadata_cls() -> type[AttentionMetadata]:
        """The per-step metadata class."""

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        """The class that builds metadata from host lists."""

    @staticmethod
    @abstractmethod
    def get_state_cls() -> type[AttentionState]:
        """The CUDA-graph state class."""

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache: K half, then V half, NHD inside a block.

        Every backend shares it, so one set of cache ops (write, copy, swap) serves all three.
        """
        sizes = dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size)
        return (2, *(as_int(name, v) for name, v in sizes.items()))

    @staticmethod
    def swap_blocks(
        src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, src_to_dst: torch.Tensor
    ) -> None:
        """Copy blocks src -> dst from one cache to another, across devices (CPU <-> CUDA) too."""
        check_block_op_args(src_kv_cache, src_to_dst, "src_kv_cache")
        check_block_op_args(dst_kv_cache, src_to_dst, "dst_kv_cache")
        torch.ops.compiled_attn.swap_blocks(src_kv_cache, dst_kv_cache, src_to_dst)

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], src_to_dists: torch.Tensor) -> None:
        """Copy blocks src -> dst within each cache of `kv_caches` (copy-on-write for forks)."""
        check_block_op_args(kv_caches, src_to_dists)
        torch.ops.compiled_attn.copy_blocks(kv_caches, src_to_dists)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine at all (package, device), or None."""
        if cls.package is None:
            return None
        return cuda_unavailable_reason(cls.package)

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        """Why this backend cannot serve `spec` (dtype, head size, feature), or None."""
        return spec_unsupported_reason(cls, spec)

    @classmethod
    def supported_head_sizes(cls) -> tuple[int, ...] | None:
        """Head sizes the kernels take; None means any."""
        return None

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        return True


class AttentionMetadataBuilder(ABC):
    """Builds one step's metadata on the host from python lists (no device syncs)."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @abstractmethod
    def build(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        encoder_seq_lens: list[int] | None = None,
        cross_block_tables: list[list[int]] | None = None,
    ) -> AttentionMetadata:
        """Request i has seq_lens[i] tokens of which the last query_lens[i] are new this step."""


class AttentionState(ABC):
    """Static buffers and per-batch-size planning so that decode steps replay as CUDA graphs.

    Call order: `graph_capture(max_batch_size)`; per size `graph_capture_get_metadata_for_batch`,
    `get_graph_input_buffers`, `graph_clone`; per step `prepare_graph_input_buffers`,
    `begin_forward`, replay. See docs/design.md, section 3. A State may capture several graphs
    per size, one per block-table width of `graph_table_widths()`: the calls without
    `table_width` mean the full width.
    """

    def __init__(self, spec: AttentionSpec) -> None:
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"a State is made from an AttentionSpec, got {type(spec).__name__}")
        check_device_available(spec.device)  # its static buffers live there
        self.spec = spec

    @contextmanager
    @abstractmethod
    def graph_capture(self, max_batch_size: int) -> Iterator[None]:
        """Allocate the static buffers for up to `max_batch_size` decodes, once."""

    def graph_table_widths(self) -> tuple[int, ...]:
        """The block-table widths (in blocks) this State captures a graph of for each batch size,
        largest first. The first is the full width, ceil(spec.max_seq_len_to_capture /
        spec.block_size); by default it is the only one."""
        return (-(-self.spec.max_seq_len_to_capture // self.spec.block_size),)

    @abstractmethod
    def graph_capture_get_metadata_for_batch(
        self, batch_size: int, *, table_width: int | None = None
    ) -> AttentionMetadata:
        """All-pad decode metadata of `batch_size` rows over the static buffers, its block table
        `table_width` blocks wide (one of `graph_table_widths()`; None: the full width)."""

    @abstractmethod
    def graph_clone(self, batch_size: int, *, table_width: int | None = None) -> AttentionState:
        """A state that owns what the metadata for `batch_size` (and `table_width`) made; keeps
        its buffers alive."""

    @abstractmethod
    def get_graph_input_buffers(self, attn_metadata: AttentionMetadata) -> dict[str, torch.Tensor]:
        """The static tensors a captured graph reads, by name."""

    @abstractmethod
    def prepare_graph_input_buffers(
        self, input_buffers: dict[str, torch.Tensor], attn_metadata: AttentionMetadata, *, upload: bool = True
    ) -> None:
        """Copy a decode-only step's metadata into the static buffers; pad the remaining rows.
        upload=False is passed only to a State whose `upload_graph_input_buffers` returned
        True: it then writes the step's host side only, and the graph's captured upload copies
        it to the buffers."""

    def upload_graph_input_buffers(self, input_buffers: dict[str, torch.Tensor]) -> bool:
        """Called first inside a graph's capture: record the host-to-device copy that fills the
        buffers as the graph's own, so that each replay uploads what the last
        `prepare_graph_input_buffers(..., upload=False)` wrote, with no host call. Returns
        whether it did; by default it does not, and `prepare_graph_input_buffers` uploads."""
        return False

    @abstractmethod
    def begin_forward(self, attn_metadata: AttentionMetadata) -> None:
        """Host-side planning for the next replay (outside any graph)."""


class AttentionImpl(ABC):
    """The forward of one attention layer: writes new K/V into the cache and attends."""

    @abstractmethod
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | torch.Tensor | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
    ) -> None: ...

    def check_matches_metadata(
        self, x: torch.Tensor, kv_cache: torch.Tensor | None, md: AttentionMetadata, attn_type: AttentionType
    ) -> None:
        """The layer fits what `md` was built (and planned) for; raises ValueError otherwise.

        Called by `validation.check_step` (inside every op, before anything is written) after the
        checks every backend shares; `x` is any input in the model's dtype. Backends that plan
        from the spec add their checks here. The answer must depend only on the layer, `md.spec`
        (and what was built from it) and the dtypes of `x` and `kv_cache`: the ops run it the
        first time a layer meets a kind of call and remember that it passed
        (`validation.check_layer_call`).
        """
        return None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        attn_type: AttentionType = AttentionType.DECODER,
    ) -> torch.Tensor:
        """query [num_tokens, num_heads * head_size] -> out of the same shape."""

"""What every backend's Impl shares: option validation, the eager forward, the traced `run`.

`run` is the sequence of custom-op calls a layer makes; Dynamo traces it (so it only reshapes
and calls ops) and the ops read the metadata from the forward context. `forward` is the eager
entry point of the contract: it sets the context to the metadata it was given and calls `run`.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from compiled_attn.abstract import (
    AttentionImpl,
    AttentionMetadata,
    AttentionType,
    check_head_counts,
    check_impl_options,
    kv_cache_torch_dtype,
)
from compiled_attn.forward_context import LayerCall, register_layer, set_forward_context
from compiled_attn.ops.common import check_metadata_backend, check_query_rows

CACHE_WRITING_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_DECODER)


class CommonImpl(AttentionImpl):
    """Shared constructor and forward; a backend sets `backend_cls` and implements `run`."""

    backend_cls: ClassVar[type]

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
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_head_counts(num_heads, num_kv_heads)
        if head_size < 1:
            raise ValueError(f"head_size must be >= 1, got {head_size}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be finite and > 0, got {scale}")
        if alibi_slopes is not None:
            alibi_slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32)
        check_impl_options(num_heads, sliding_window, logits_soft_cap, alibi_slopes)
        kv_cache_torch_dtype(kv_cache_dtype, torch.float32)  # validates the name
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = alibi_slopes
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap
        self.check_supported()
        self._alibi_by_device: dict[torch.device, torch.Tensor] = {}
        self._eager_calls: dict[tuple[float, float, AttentionType], tuple[str, LayerCall]] = {}

    def alibi_on(self, device: torch.device) -> torch.Tensor | None:
        """The ALiBi slopes on `device`, copied once (at the first, eager call: never in a graph)."""
        if self.alibi_slopes is None:
            return None
        if device not in self._alibi_by_device:
            self._alibi_by_device[device] = self.alibi_slopes.to(device)
        return self._alibi_by_device[device]

    def register(self, k_scale: float, v_scale: float, attn_type: AttentionType) -> tuple[str, LayerCall]:
        """A layer name for the ops, and the record to keep alive as long as the name is used."""
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not math.isfinite(x) or x <= 0:  # fp8 caches store K / k_scale
                raise ValueError(f"{name} must be finite and > 0, got {x}")
        call = LayerCall(self, float(k_scale), float(v_scale), self.check_attn_type(attn_type))
        return register_layer(call), call

    def check_supported(self) -> None:
        """NotImplementedError for options this backend lacks, naming backends that have them."""
        self._require(head_size=self.head_size, kv_cache_dtype=self.kv_cache_dtype,
                      alibi=self.alibi_slopes is not None, sliding_window=self.sliding_window is not None,
                      logits_soft_cap=self.logits_soft_cap is not None)

    def _require(self, **needs: object) -> None:
        from compiled_attn.registry import backends_with, capability_reason

        reason = capability_reason(self.backend_cls, **needs)
        if reason is not None:
            others = backends_with(**needs)
            raise NotImplementedError(f"{reason}; use {' or '.join(others) if others else 'no backend has it'}")

    def check_attn_type(self, attn_type: AttentionType) -> AttentionType:
        attn_type = AttentionType(attn_type)
        self._require(attn_type=attn_type)
        # Window and ALiBi are defined over query/key positions of one sequence; no backend
        # gives them a meaning across the encoder/decoder boundary or without causality.
        if self.sliding_window is not None and attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"sliding_window is defined for DECODER attention only, not {attn_type.name}")
        if self.alibi_slopes is not None and attn_type == AttentionType.ENCODER_DECODER:
            raise NotImplementedError("ALiBi is not defined for ENCODER_DECODER (cross) attention")
        return attn_type

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
        """Eager attention for one layer.

        query: [num_tokens, num_heads * head_size]; key/value: [num_tokens, num_kv_heads *
        head_size] or None (cross attention after the encoder step); kv_cache: [2, num_blocks,
        block_size, num_kv_heads, head_size] or None (encoder types). Returns [num_tokens,
        num_heads * head_size] in query's dtype.
        """
        key_ = (float(k_scale), float(v_scale), AttentionType(attn_type))
        if key_ not in self._eager_calls:
            self._eager_calls[key_] = self.register(*key_)
        layer_name = self._eager_calls[key_][0]
        # everything the ops would check, checked before the first op writes the cache
        self.check_inputs(query, key, value, kv_cache, key_[2])
        if not isinstance(attn_metadata, AttentionMetadata):
            raise ValueError(f"attn_metadata must be AttentionMetadata from a builder, got {type(attn_metadata)}")
        check_metadata_backend(attn_metadata, self.backend_cls.get_name())
        check_query_rows(query, attn_metadata, key_[2])
        self.check_matches_metadata(query, kv_cache, attn_metadata, key_[2])
        with set_forward_context(attn_metadata):
            return self.run(query, key, value, kv_cache, key_[2], layer_name)

    def run(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_type: AttentionType,
        layer_name: str,
    ) -> torch.Tensor:
        """The traced path: reshape, write the cache, call this backend's attention op."""
        self.check_inputs(query, key, value, kv_cache, attn_type)
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = None if key is None else key.view(-1, self.num_kv_heads, self.head_size)
        v = None if value is None else value.view(-1, self.num_kv_heads, self.head_size)
        if k is not None and kv_cache is not None and attn_type in CACHE_WRITING_TYPES:
            torch.ops.compiled_attn.kv_cache_update(k, v, kv_cache, layer_name)
        output = torch.empty_like(q)
        self.attention(q, k, v, kv_cache, output, layer_name)
        return output.view(num_tokens, self.num_heads * self.head_size)

    def check_inputs(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_type: AttentionType,
    ) -> None:
        """Shape, dtype and device checks that need no metadata (they run at trace time too)."""
        q_width = self.num_heads * self.head_size
        kv_width = self.num_kv_heads * self.head_size
        if query.dim() != 2 or query.shape[1] != q_width:
            raise ValueError(
                f"query must be [num_tokens, num_heads * head_size = {q_width}], got {tuple(query.shape)}"
            )
        if not query.dtype.is_floating_point:
            raise ValueError(f"query/key/value dtype {query.dtype} must be one float dtype")
        if (key is None) != (value is None):
            raise ValueError("key and value must both be tensors or both be None")
        if key is None:
            if attn_type != AttentionType.ENCODER_DECODER:
                raise ValueError(f"key/value may be None only for cross attention, not {attn_type.name}")
        else:
            for name, t in (("key", key), ("value", value)):
                if t.dim() != 2 or t.shape[1] != kv_width:
                    raise ValueError(
                        f"{name} must be [num_tokens, num_kv_heads * head_size = {kv_width}], "
                        f"got {tuple(t.shape)}"
                    )
                if t.dtype != query.dtype:
                    raise ValueError(f"{name} dtype {t.dtype} != query dtype {query.dtype}")
                if t.device != query.device:
                    raise ValueError(f"{name} is on {t.device}, query on {query.device}: move them to one device")
        if attn_type in CACHE_WRITING_TYPES:
            if kv_cache is None:
                raise ValueError(f"{attn_type.name} attention needs a kv_cache")
            if kv_cache.dim() != 5 or tuple(kv_cache.shape[3:]) != (self.num_kv_heads, self.head_size):
                raise ValueError(
                    f"kv_cache must be [2, num_blocks, block_size, {self.num_kv_heads}, "
                    f"{self.head_size}], got {tuple(kv_cache.shape)}"
                )
            if kv_cache.device != query.device:
                raise ValueError(f"kv_cache is on {kv_cache.device}, query on {query.device}: move them to one device")
            want = kv_cache_torch_dtype(self.kv_cache_dtype, query.dtype)
            if kv_cache.dtype != want:
                raise ValueError(
                    f"kv_cache dtype {kv_cache.dtype} != {want} (kv_cache_dtype={self.kv_cache_dtype!r}, query "
                    f"{query.dtype}): allocate the cache with kv_cache_torch_dtype(kv_cache_dtype, model dtype)"
                )

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        output: torch.Tensor,
        layer_name: str,
    ) -> None:
        """Call this backend's attention op (writes `output` [num_tokens, num_heads, head_size])."""
        raise NotImplementedError

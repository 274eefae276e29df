"""What every backend's Impl shares: option validation, the eager forward, the traced `run`.

`run` is the sequence of custom-op calls a layer makes; Dynamo traces it (so it only reshapes
and calls ops) and the ops read the metadata from the forward context. `forward` is the eager
entry point of the contract: it sets the context to the metadata it was given and calls `run`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

import torch

from compiled_attn.abstract import AttentionBackend, AttentionImpl, AttentionMetadata, AttentionType
from compiled_attn.capabilities import capability_reason
from compiled_attn.forward_context import LayerCall, register_layer, set_forward_context
from compiled_attn.registry import alternatives
from compiled_attn.validation import (
    CACHE_WRITING_TYPES,
    as_attn_type,
    check_impl_args,
    check_kv_scales,
    check_metadata,
    check_tensors,
)

# Eager `forward` registers one layer name per (k_scale, v_scale, attn_type) it is called with;
# the most recent few are kept (a caller varying its scales every step must not grow a registry).
EAGER_NAMES_KEPT = 8
# A layer's options, fixed at construction: the ops check a layer once per kind of call and
# remember it passed (`validation.check_layer_call`), so a changed option would go unchecked.
IMPL_OPTIONS = frozenset(("num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes", "sliding_window",
                          "kv_cache_dtype", "logits_soft_cap"))


class CommonImpl(AttentionImpl):
    """Shared constructor and forward; a backend sets `backend_cls`, whose `attention_op` `run` calls."""

    backend_cls: ClassVar[type[AttentionBackend]]

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
        args = check_impl_args(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                               kv_cache_dtype, logits_soft_cap)
        self.num_heads: int = args["num_heads"]
        self.head_size: int = args["head_size"]
        self.scale: float = args["scale"]
        self.num_kv_heads: int = args["num_kv_heads"]
        self.alibi_slopes: torch.Tensor | None = args["alibi_slopes"]
        self.sliding_window: int | None = args["sliding_window"]
        self.kv_cache_dtype: str = args["kv_cache_dtype"]
        self.logits_soft_cap: float | None = args["logits_soft_cap"]
        self.check_supported()
        self._alibi_by_device: dict[torch.device, torch.Tensor] = {}
        self._eager_calls: OrderedDict[tuple[float, float, AttentionType], tuple[str, LayerCall]] = OrderedDict()

    def __setattr__(self, name: str, value: object) -> None:
        if name in IMPL_OPTIONS and name in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.{name} is fixed at construction (the ops remember that "
                                 "this layer's checks passed): make a new layer with the option you want")
        super().__setattr__(name, value)

    def alibi_on(self, device: torch.device) -> torch.Tensor | None:
        """The ALiBi slopes on `device`, copied once (at the first, eager call: never in a graph)."""
        if self.alibi_slopes is None:
            return None
        if device not in self._alibi_by_device:
            self._alibi_by_device[device] = self.alibi_slopes.to(device)
        return self._alibi_by_device[device]

    def register(self, k_scale: float, v_scale: float, attn_type: AttentionType,
                 group: str | None = None) -> tuple[str, LayerCall]:
        """A layer name for the ops, and the record to keep alive as long as the name is used;
        `group`: the layer group whose metadata the ops read (see `compiled_attn.groups`)."""
        k_scale, v_scale = check_kv_scales(k_scale, v_scale)
        if group is not None and not isinstance(group, str):
            raise ValueError(f"group must be a str (a layer group's name) or None, got {type(group).__name__}")
        call = LayerCall(self, k_scale, v_scale, self.check_attn_type(attn_type), group)
        return register_layer(call), call

    def check_supported(self) -> None:
        """NotImplementedError for options this backend lacks, naming backends that have them."""
        self._require(**self._option_needs())

    def _option_needs(self) -> dict[str, object]:
        return dict(head_size=self.head_size, kv_cache_dtype=self.kv_cache_dtype, alibi=self.alibi_slopes is not None,
                    sliding_window=self.sliding_window is not None, logits_soft_cap=self.logits_soft_cap is not None)

    def _require(self, **needs: object) -> None:
        reason = capability_reason(self.backend_cls, **needs)
        if reason is not None:
            # the backends named instead serve the layer's options too, not only what this one lacks
            raise NotImplementedError(f"{reason}; {alternatives(**{**self._option_needs(), **needs})}")

    def check_attn_type(self, attn_type: AttentionType) -> AttentionType:
        attn_type = as_attn_type(attn_type)
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
        num_heads * head_size] in query's dtype. Every check runs before anything is written:
        the arguments here, the step inside the ops (`validation.check_step`).
        """
        key_ = (*check_kv_scales(k_scale, v_scale), self.check_attn_type(attn_type))
        check_tensors(self, query, key, value, kv_cache, key_[2])
        check_metadata(attn_metadata, self.backend_cls.get_name())
        new = key_ not in self._eager_calls
        # the record held until the ops return: another thread's calls may evict it meanwhile,
        # and a dead layer's name goes to the next layer of its kind
        layer_name, _record = self._eager_name(key_)
        try:
            with set_forward_context(attn_metadata):
                out = self.run(query, key, value, kv_cache, key_[2], layer_name)
        except BaseException:
            if new:  # a refused call leaves no registration behind, and evicts none
                self._eager_calls.pop(key_, None)
            raise
        while len(self._eager_calls) > EAGER_NAMES_KEPT:  # a call that ran takes the oldest one's place
            self._eager_calls.popitem(last=False)  # its record dies: the registry drops the name
        return out

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        # a copy's eager calls register names of their own: the copied ones are its original's
        self._eager_calls = OrderedDict()

    def _eager_name(self, key: tuple[float, float, AttentionType]) -> tuple[str, LayerCall]:
        """The layer name eager calls with these scales and type use, and its record (kept for
        the latest few, once a call with it has run)."""
        if key in self._eager_calls:
            self._eager_calls.move_to_end(key)
        else:
            self._eager_calls[key] = self.register(*key)
        return self._eager_calls[key]

    def run(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_type: AttentionType,
        layer_name: str,
    ) -> torch.Tensor:
        """The traced path: reshape, write the cache, call this backend's `attention_op` (which
        writes `output` [num_tokens, num_heads, head_size]).

        The ops check the step against the metadata (`validation.check_step`) before they write
        or read; the cache write gets the query too, so that a query of the wrong row count is
        refused before any K/V is stored.
        """
        check_tensors(self, query, key, value, kv_cache, attn_type)
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = None if key is None else key.view(-1, self.num_kv_heads, self.head_size)
        v = None if value is None else value.view(-1, self.num_kv_heads, self.head_size)
        # Allocated before the cache write, so that the two ops are adjacent in the traced graph:
        # the piecewise runner (graphs/split.py) then cuts once around both (or, where it captures
        # the write, just before attention), not around an allocation-only piece between them.
        output = torch.empty_like(q)
        if k is not None and kv_cache is not None and attn_type in CACHE_WRITING_TYPES:
            torch.ops.compiled_attn.kv_cache_update(q, k, v, kv_cache, layer_name)
        self.backend_cls.attention_op(q, k, v, kv_cache, output, layer_name)
        return output.view(num_tokens, self.num_heads * self.head_size)

"""The contract's plain data: attention types, KV-cache dtype names, the metadata base class and
the backend environment variable's name.

They live below every other module (this one imports nothing of compiled_attn) because
`validation` needs them and `abstract`'s classes call `validation`; `abstract` re-exports them,
and `compiled_attn` exports them as part of the public contract (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import enum
from abc import abstractmethod
from typing import Any

import torch

# the backend every layer and `get_attn_backend(None)` take when set (registry.get_attn_backend)
ENV_VAR = "COMPILED_ATTN_BACKEND"


class AttentionType(str, enum.Enum):
    """Which tokens attend to which: causal self-attention, bidirectional, or cross attention."""

    DECODER = "decoder"  # causal self-attention over the request's cached + new keys
    ENCODER = "encoder"  # bidirectional over the encoder tokens of an encoder-decoder model
    ENCODER_ONLY = "encoder_only"  # bidirectional over the request's tokens (BERT-style), no cache
    ENCODER_DECODER = "encoder_decoder"  # decoder queries attend to the request's encoder K/V


KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element type to allocate KV caches with.

    >>> kv_cache_torch_dtype("fp8", torch.bfloat16)
    torch.float8_e4m3fn
    """
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not one of {sorted(KV_CACHE_DTYPES)}"
        )
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or dtype


@dataclasses.dataclass
class AttentionMetadata:
    """Device-side description of one step: prefills first, then decodes.

    Tensors (all on the spec's device):
        slot_mapping: int64 [num_tokens], cache slot of each new token; -1 is a pad (no write).
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor

    @property
    @abstractmethod
    def prefill_metadata(self) -> AttentionMetadata | None:
        """The same step restricted to its prefills, or None when there are none."""

    @property
    @abstractmethod
    def decode_metadata(self) -> AttentionMetadata | None:
        """The same step restricted to its decodes, or None when there are none."""

    def asdict_zerocopy(self, skip_fields: set[str] | None = None) -> dict[str, Any]:
        """Fields as a dict without copying tensors (to rebuild a variant of this metadata)."""
        skip = skip_fields or set()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}

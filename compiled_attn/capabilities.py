"""Capability checks: what a backend class declares it can do, against what a spec, a layer or a
graph needs.

The one place capabilities are checked: specs (`AttentionBackend.unsupported_reason`), builders
(`CommonMetadataBuilder`), impls (`CommonImpl.check_supported`) and graph States
(`GraphState.graph_capture`) all come here; `registry.backends_with` asks it of every registered
backend to name one that does support a need. It reads only the data the contract declares on a
backend class (`supported_dtypes`, `supports_alibi`, `graph_attn_types`, ...) and imports only
`validation` of compiled_attn at run time (the contract's classes only for type annotations), so
`abstract` can call it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from compiled_attn.validation import INT32_MAX, as_int

if TYPE_CHECKING:  # annotations only: `abstract` imports this module
    from compiled_attn.abstract import AttentionBackend, AttentionSpec


def capability_reason(
    cls: type[AttentionBackend],
    *,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
    attn_type: object = None,
    head_size: int | None = None,
    block_size: int | None = None,
    alibi: bool = False,
    sliding_window: bool = False,
    logits_soft_cap: bool = False,
    device: torch.device | None = None,
    graphs: bool = False,
) -> str | None:
    """Why `cls` lacks one of these needs (None: unknown, not checked), naming what it supports.

    attn_type: an AttentionType or None. `graphs`: the attention type and ALiBi must also be
    captured by its State in CUDA graphs.
    """
    name = cls.get_name()
    heads = cls.supported_head_sizes()
    checks = (
        (dtype is not None and dtype not in cls.supported_dtypes,
         f"supports dtypes {cls.supported_dtypes}, not {dtype}"),
        (kv_cache_dtype not in cls.supported_kv_cache_dtypes,
         f"does not support kv_cache_dtype={kv_cache_dtype!r} (only {cls.supported_kv_cache_dtypes})"),
        (attn_type is not None and attn_type not in cls.supported_attn_types,
         f"does not support {getattr(attn_type, 'name', attn_type)} attention"),
        (head_size is not None and heads is not None and head_size not in heads,
         f"supports head sizes {heads}, not {head_size}"),
        (block_size is not None and not cls.supports_block_size(block_size),
         f"does not support block_size={block_size}"),
        (alibi and not cls.supports_alibi, "does not support ALiBi"),
        (sliding_window and not cls.supports_sliding_window, "does not support sliding_window"),
        (logits_soft_cap and not cls.supports_logits_soft_cap, "does not support logits_soft_cap"),
        (alibi and logits_soft_cap and not cls.supports_alibi_with_soft_cap,
         "cannot combine ALiBi with logits_soft_cap"),
        (device is not None and cls.requires_cuda and device.type != "cuda", f"runs on CUDA only, not {device}"),
        (graphs and attn_type is not None and attn_type not in cls.graph_attn_types,
         f"captures decode steps of {'/'.join(t.name for t in cls.graph_attn_types)} specs only, "
         f"not {getattr(attn_type, 'name', attn_type)}"),
        (graphs and alibi and not cls.graph_supports_alibi, "runs ALiBi eagerly only, not in CUDA graphs"),
    )
    return next((f"{name} {why}" for failed, why in checks if failed), None)


def spec_needs(spec: AttentionSpec) -> dict[str, object]:
    """What serving `spec` needs, as `capability_reason` keywords."""
    return dict(
        dtype=spec.dtype, kv_cache_dtype=spec.kv_cache_dtype, attn_type=spec.attn_type,
        head_size=spec.head_size, block_size=spec.block_size, alibi=spec.alibi_slopes is not None,
        sliding_window=spec.sliding_window is not None, logits_soft_cap=spec.logits_soft_cap is not None,
        device=spec.device,
    )


def spec_unsupported_reason(cls: type[AttentionBackend], spec: AttentionSpec) -> str | None:
    """Why `cls` cannot serve `spec`, naming what it does support; None if it can."""
    return capability_reason(cls, **spec_needs(spec))


def cuda_unavailable_reason(package: str) -> str | None:
    """Shared probe for the CUDA-only backends: the package imports and a GPU is visible."""
    if importlib.util.find_spec(package) is None:
        return f"package {package!r} is not installed (pip install 'compiled_attn[{package}]')"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def smallest_block_size(cls: type[AttentionBackend], at_least: int = 16) -> int:
    """The first of `at_least`, 2 * `at_least`, 4 * `at_least`, ... that `cls` takes as a block
    size (xFormers' paged decode reads 64-key tiles), up to the largest a spec holds (int32):
    what benchmarks and tests use instead of naming a backend."""
    # 0 or below would come back as a block size (XFORMERS takes 0 and -64), or double forever
    block_size = as_int("at_least", at_least)
    while block_size <= INT32_MAX:
        if cls.supports_block_size(block_size):
            return block_size
        block_size *= 2
    raise ValueError(f"{cls.get_name()} supports no block size from {at_least} to {INT32_MAX} (a spec's largest)")

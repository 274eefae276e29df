"""Backend names -> classes, availability probing and `get_attn_backend`.

The only place that dispatches on backend names. Backend modules import without their
packages (flashinfer, xformers) so that CPU machines can inspect and test them.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from compiled_attn.abstract import AttentionBackend, AttentionSpec, AttentionType

ENV_VAR = "COMPILED_ATTN_BACKEND"
# Auto-selection order: fastest first.
BACKEND_PATHS = {
    "FLASHINFER": "compiled_attn.backends.flashinfer:FlashInferBackend",
    "XFORMERS": "compiled_attn.backends.xformers:XFormersBackend",
    "TORCH_SDPA": "compiled_attn.backends.torch_sdpa:TorchSDPABackend",
}


class BackendUnavailableError(RuntimeError):
    """A named backend cannot run on this machine (package missing, no CUDA device)."""


@functools.cache
def BACKEND_CLASSES() -> dict[str, type[AttentionBackend]]:  # noqa: N802  (a constant, built lazily)
    """Every backend class this version ships, by name, in auto-selection order."""
    out = {}
    for name, path in BACKEND_PATHS.items():
        module, _, attr = path.partition(":")
        try:
            out[name] = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    return out


def capability_reason(
    cls: type[AttentionBackend],
    *,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
    attn_type: AttentionType | None = None,
    head_size: int | None = None,
    block_size: int | None = None,
    alibi: bool = False,
    sliding_window: bool = False,
    logits_soft_cap: bool = False,
    device: torch.device | None = None,
    graphs: bool = False,
) -> str | None:
    """Why `cls` lacks one of these needs (None: unknown, not checked), naming what it supports.
    `graphs`: the attention type and ALiBi must also be captured by its State in CUDA graphs.

    The one place capabilities are checked: specs (`spec_unsupported_reason`), impls
    (`CommonImpl.check_supported`) and graph States (`GraphState.graph_capture`) all come here."""
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
        (device is not None and cls.requires_cuda and device.type != "cuda", f"runs on CUDA only, not {device}"),
        (graphs and attn_type is not None and attn_type not in cls.graph_attn_types,
         f"captures decode steps of {'/'.join(t.name for t in cls.graph_attn_types)} specs only, "
         f"not {getattr(attn_type, 'name', attn_type)}"),
        (graphs and alibi and not cls.graph_supports_alibi, "runs ALiBi eagerly only, not in CUDA graphs"),
    )
    return next((f"{name} {why}" for failed, why in checks if failed), None)


def backends_with(**needs: object) -> list[str]:
    """Names of the backends that have every one of `needs` (see `capability_reason`)."""
    return [n for n, c in BACKEND_CLASSES().items() if capability_reason(c, **needs) is None]


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


def _supporters(spec: AttentionSpec) -> list[str]:
    return [n for n, c in BACKEND_CLASSES().items() if c.unsupported_reason(spec) is None]


def get_attn_backend(name: str | None = None, spec: AttentionSpec | None = None) -> type[AttentionBackend]:
    """The backend class to use.

    name: "TORCH_SDPA" | "FLASHINFER" | "XFORMERS" | None. None reads $COMPILED_ATTN_BACKEND,
    else picks the first of FLASHINFER, XFORMERS, TORCH_SDPA that is installed, has its device
    and supports `spec`.

    Raises ValueError for an unknown name, BackendUnavailableError (a RuntimeError) when the
    named backend cannot run here, NotImplementedError when it cannot serve `spec`.

    >>> backend = get_attn_backend("TORCH_SDPA")
    >>> backend.get_name()
    'TORCH_SDPA'
    """
    name = name or os.environ.get(ENV_VAR) or None
    if spec is not None and not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an AttentionSpec or None, got {type(spec).__name__}")
    classes = BACKEND_CLASSES()
    if name is not None:
        if not isinstance(name, str):
            raise ValueError(f"unknown attention backend {name!r}; choose one of {list(BACKEND_PATHS)}")
        key = name.upper()
        if key not in BACKEND_PATHS:
            raise ValueError(f"unknown attention backend {name!r}; choose one of {list(BACKEND_PATHS)}")
        if key not in classes:
            raise BackendUnavailableError(f"{key} is not implemented in this version of compiled_attn")
        cls = classes[key]
        reason = cls.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"{key} cannot run here: {reason}")
        if spec is not None:
            reason = cls.unsupported_reason(spec)  # a backend may add reasons of its own
            if reason is not None:
                others = [n for n in _supporters(spec) if n != key]
                hint = f"; {' or '.join(others)} supports this spec" if others else ""
                raise NotImplementedError(reason + hint)
        return cls
    reasons = []
    for key, cls in classes.items():
        reason = cls.unavailable_reason() or (spec and cls.unsupported_reason(spec))
        if not reason:
            return cls
        reasons.append(f"{key}: {reason}")
    raise NotImplementedError("no attention backend can serve this: " + "; ".join(reasons))


def cuda_unavailable_reason(package: str) -> str | None:
    """Shared probe for the CUDA-only backends: the package imports and a GPU is visible."""
    if importlib.util.find_spec(package) is None:
        return f"package {package!r} is not installed (pip install 'compiled_attn[{package}]')"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None

"""Backend names -> classes, availability probing and `get_attn_backend`.

The only place that dispatches on backend names. Backend modules import without their
packages (flashinfer, xformers) so that CPU machines can inspect and test them.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from compiled_attn.abstract import AttentionBackend, AttentionSpec

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


def spec_unsupported_reason(cls: type[AttentionBackend], spec: AttentionSpec) -> str | None:
    """Why `cls` cannot serve `spec`, naming what it does support; None if it can."""
    name = cls.get_name()
    if spec.dtype not in cls.supported_dtypes:
        return f"{name} supports dtypes {cls.supported_dtypes}, not {spec.dtype}"
    if spec.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
        return f"{name} supports kv_cache_dtype {cls.supported_kv_cache_dtypes}, not {spec.kv_cache_dtype!r}"
    if spec.attn_type not in cls.supported_attn_types:
        return f"{name} does not support {spec.attn_type.name} attention"
    heads = cls.supported_head_sizes()
    if heads is not None and spec.head_size not in heads:
        return f"{name} supports head sizes {heads}, not {spec.head_size}"
    if not cls.supports_block_size(spec.block_size):
        return f"{name} does not support block_size={spec.block_size}"
    for wanted, flag, label in (
        (spec.alibi_slopes is not None, cls.supports_alibi, "ALiBi"),
        (spec.sliding_window is not None, cls.supports_sliding_window, "sliding_window"),
        (spec.logits_soft_cap is not None, cls.supports_logits_soft_cap, "logits_soft_cap"),
    ):
        if wanted and not flag:
            return f"{name} does not support {label}"
    if cls.requires_cuda and spec.device.type != "cuda":
        return f"{name} runs on CUDA only, the spec's device is {spec.device}"
    return None


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
    classes = BACKEND_CLASSES()
    if name is not None:
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

"""Backend names -> classes, availability probing and `get_attn_backend`.

The only place that dispatches on backend names. A backend is known once it is registered
(`register_backend`): `compiled_attn.backends` registers the shipped ones, in auto-selection
order, when `compiled_attn` is imported. This module imports no backend, so the backends'
shared code (`backends.common`, `graph_state`) can ask it which backends support a need.
Backend modules import without their packages (flashinfer, xformers) so that CPU machines can
inspect and test them.
"""

from __future__ import annotations

import os

from compiled_attn.abstract import AttentionBackend, AttentionSpec
from compiled_attn.base import ENV_VAR
from compiled_attn.capabilities import capability_reason

# name -> class, in auto-selection order (fastest first): filled by register_backend
_BACKENDS: dict[str, type[AttentionBackend]] = {}


class BackendUnavailableError(RuntimeError):
    """A named backend cannot run on this machine (package missing, no CUDA device)."""


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Make `cls` known under `cls.get_name()`, last in auto-selection order; returns `cls`.

    ValueError for a class that is not an AttentionBackend or a name another class holds.

    Example (a test's own backend, for the test's duration)::

        register_backend(MyBackend)
        try:
            ...
        finally:
            unregister_backend(MyBackend)
    """
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise ValueError(f"register_backend takes an AttentionBackend subclass, got {cls!r}")
    name = cls.get_name()
    if not isinstance(name, str) or name != name.upper():  # get_attn_backend looks names up in upper case
        raise ValueError(f"backend names are upper-case (get_attn_backend matches any case), got {name!r}")
    if _BACKENDS.get(name, cls) is not cls:
        raise ValueError(f"a backend named {name} is registered already ({_BACKENDS[name].__qualname__})")
    _BACKENDS[name] = cls
    return cls


def unregister_backend(cls: type[AttentionBackend]) -> None:
    """Forget `cls` (a no-op if it is not registered)."""
    if _BACKENDS.get(cls.get_name()) is cls:
        del _BACKENDS[cls.get_name()]


def BACKEND_CLASSES() -> dict[str, type[AttentionBackend]]:  # noqa: N802  (reads as the constant it was)
    """Every registered backend class, by name, in auto-selection order (a copy)."""
    return dict(_BACKENDS)


def backends_with(**needs: object) -> list[str]:
    """Names of the backends that have every one of `needs` (see `capabilities.capability_reason`)."""
    return [n for n, c in _BACKENDS.items() if capability_reason(c, **needs) is None]


def alternatives(**needs: object) -> str:
    """The end of an error for a backend that lacks `needs`: the backends to use instead."""
    others = backends_with(**needs)
    return f"use {' or '.join(others)}" if others else "no registered backend has all of them"


def _supporters(spec: AttentionSpec) -> list[str]:
    return [n for n, c in _BACKENDS.items() if c.unsupported_reason(spec) is None]


def get_attn_backend(name: str | None = None, spec: AttentionSpec | None = None) -> type[AttentionBackend]:
    """The backend class to use.

    name: "TORCH_SDPA" | "FLASHINFER" | "XFORMERS" (any registered name, any case) | None. None
    reads $COMPILED_ATTN_BACKEND, else picks the first of FLASHINFER, XFORMERS, TORCH_SDPA that is
    installed, has its device and supports `spec`.

    Raises ValueError for an unknown name, BackendUnavailableError (a RuntimeError) when the
    named backend cannot run here, NotImplementedError when it cannot serve `spec`.

    >>> backend = get_attn_backend("TORCH_SDPA")
    >>> backend.get_name()
    'TORCH_SDPA'
    """
    source = ""
    if name is None:  # an empty or falsy name given is an unknown one, not "pick for me"
        name = os.environ.get(ENV_VAR) or None
        source = f" (from ${ENV_VAR})" if name is not None else ""
    if spec is not None and not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an AttentionSpec or None, got {type(spec).__name__}")
    if name is not None:
        key = name.upper() if isinstance(name, str) else None
        if key not in _BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}{source}; choose one of {list(_BACKENDS)}")
        cls = _BACKENDS[key]
        reason = cls.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"{key}{source} cannot run here: {reason}")
        if spec is not None:
            reason = cls.unsupported_reason(spec)  # a backend may add reasons of its own
            if reason is not None:
                others = [n for n in _supporters(spec) if n != key]
                hint = f"; {' or '.join(others)} supports this spec" if others else "; no registered backend does"
                raise NotImplementedError(reason + hint)
        return cls
    reasons = []
    for key, cls in _BACKENDS.items():
        reason = cls.unavailable_reason() or (spec and cls.unsupported_reason(spec))
        if not reason:
            return cls
        reasons.append(f"{key}: {reason}")
    raise NotImplementedError("no attention backend can serve this: " + "; ".join(reasons))

"""argparse types shared by `python -m compiled_attn`, the bench entry points and scripts/: each
refuses a bad value when the arguments are parsed (exit 2 with usage), not after a run."""

from __future__ import annotations

import argparse
import ast
import os

from compiled_attn.registry import BACKEND_CLASSES


def positive_int(text: str) -> int:
    """An int >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def point(text: str) -> tuple[int, int]:
    """A decode point BxCTX (batch x context tokens), both ints >= 1."""
    parts = text.split("x")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not BxCTX (e.g. 64x1024)")
    return positive_int(parts[0]), positive_int(parts[1])


def output_dir(text: str) -> str:
    """A folder the results can be written to: a writable one, or one that can be made in the
    nearest existing folder above it. A bad --out fails before the run; nothing is made here
    (the run makes it), so a command refused for another argument leaves no folder behind."""
    if not text:
        raise argparse.ArgumentTypeError("an empty name is no folder: give one, e.g. --out results")
    existing = text
    while not os.path.lexists(existing):  # a dangling link exists for makedirs: not a folder, refused below
        parent = os.path.dirname(existing.rstrip(os.sep)) or os.curdir
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(f"cannot make folder {text!r}: {existing!r} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"folder {existing!r} is not writable")
    return text


def backend_name(text: str) -> str:
    """A backend name (any case) the registry knows, upper-cased."""
    if text.upper() not in BACKEND_CLASSES():
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; choose one of {list(BACKEND_CLASSES())}")
    return text.upper()


def inductor_option(text: str) -> tuple[str, object]:
    """KEY=VALUE: an Inductor config option (`torch._inductor.config`) and a Python literal value
    (True, 8, "x")."""
    from torch._inductor import config  # torch is imported by the callers anyway; not at CLI start-up

    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    owner = config
    for part in key.split("."):  # nested ones too: triton.enable_pdl
        if not hasattr(owner, part):
            raise argparse.ArgumentTypeError(f"{key!r} is not an Inductor option (torch._inductor.config)")
        owner = getattr(owner, part)
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a Python literal") from None

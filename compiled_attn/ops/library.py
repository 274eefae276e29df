"""How our ops are registered: `Library.define` + one CompositeExplicitAutograd kernel.

Measured with `python -m compiled_attn bench` (suite `overhead`): a no-op through
`torch.library.custom_op` costs ~11.6 us per eager call on CPU, through `Library.define` ~1.6 us
(the custom_op wrapper re-checks mutations and aliasing on every call). Two ops per layer and
32 layers make that ~0.6 ms per eager or compiled-without-graphs step, so every op here takes
the cheaper route; under CUDA-graph replay neither costs anything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LIB = torch.library.Library("compiled_attn", "FRAGMENT")


def define_op(schema: str) -> Callable[[Callable], Callable]:
    """Define `compiled_attn::<schema>` with the decorated function as its kernel on every device.

    Mutated arguments are annotated in the schema (`Tensor(a!) output`); the fake kernel is
    registered right below the op with `register_fake(name)`.
    """

    def register(kernel: Callable) -> Callable:
        name = schema.split("(", 1)[0]
        LIB.define(schema)
        LIB.impl(name, kernel, "CompositeExplicitAutograd")
        return kernel

    return register


def register_fake(name: str) -> Callable[[Callable], Callable]:
    """Register the fake (shape-only) kernel of `compiled_attn::<name>`."""
    return torch.library.register_fake(f"compiled_attn::{name}", lib=LIB)

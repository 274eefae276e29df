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
# qualified op name -> its Python kernel (the piecewise op groups call it; the bench times the
# dispatcher's call against it)
_KERNELS: dict[str, Callable] = {}


def define_op(schema: str, *, reads_forward_context: bool) -> Callable[[Callable], Callable]:
    """Define `compiled_attn::<schema>` with the decorated function as its kernel on every device.

    Mutated arguments are annotated in the schema (`Tensor(a!) output`); the fake kernel is
    registered right below the op with `register_fake(name)`.

    An op that reads the forward context is tagged `cudagraph_unsafe`: PyTorch's own CUDA graphs
    (`torch.compile(mode="reduce-overhead")`) copy only graph inputs before a replay, so a captured
    call would replay the metadata of the step it was captured in. With the tag Inductor splits
    its graphs around these ops and runs them eagerly, reading each step's metadata.
    `compiled_attn.graphs.CUDAGraphRunner` captures them safely: its State refills the static
    metadata buffers the captured kernels read.

    Every op is tagged `flexible_layout`: it takes its tensors with whatever strides eager code
    may pass (a fused QKV projection's column slices, say), as ATen's own ops do. Under the
    default (`needs_exact_strides`) Inductor copies an input that is a view of a not yet stored
    result once per op that reads it: the cache write and the attention op each got their own
    copy of the rotated q and k, and of v, a slice of the QKV matmul (stored twice in one kernel).
    """
    tags = (torch.Tag.flexible_layout, *((torch.Tag.cudagraph_unsafe,) if reads_forward_context else ()))

    def register(kernel: Callable) -> Callable:
        name = schema.split("(", 1)[0]
        LIB.define(schema, tags=tags)
        LIB.impl(name, kernel, "CompositeExplicitAutograd")
        _KERNELS[f"{LIB.ns}::{name}"] = kernel
        return kernel

    return register


def python_kernel(op: torch._ops.OpOverloadPacket | torch._ops.OpOverload) -> Callable:
    """The Python function registered as `op`'s kernel (one of ours, e.g. a backend's
    `attention_op`), to call without the dispatcher."""
    overload = op.default if isinstance(op, torch._ops.OpOverloadPacket) else op
    return _KERNELS[overload.name()]


def register_fake(name: str) -> Callable[[Callable], Callable]:
    """Register the fake (shape-only) kernel of `compiled_attn::<name>`."""
    return torch.library.register_fake(f"compiled_attn::{name}", lib=LIB)


# Every backend's attention op takes these arguments (the bench times a no-op of this schema: the
# dispatcher's own cost for our calls)
ATTENTION_SIGNATURE = (
    "(Tensor query, Tensor? key, Tensor? value, Tensor? kv_cache, Tensor(a!) output, str layer_name) -> ()"
)


def define_attention_op(name: str) -> Callable[[Callable], Callable]:
    """A backend's attention op: one signature for all backends (reads the forward context). The
    backend class names it once, as `attention_op`, which every Impl calls.

    query/output: [num_tokens, num_heads, head_size]; key/value: [num_tokens, num_kv_heads,
    head_size] or None; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size] or None.
    """
    return define_op(name + ATTENTION_SIGNATURE, reads_forward_context=True)

"""Cut a Dynamo FX graph at the ops that read the forward context: pure FX, no device.

The ops of `compiled_attn` that read the step's metadata (the cache write and every backend's
attention op) carry `torch.Tag.cudagraph_unsafe` (`ops.library.define_op`). A captured graph
would replay the metadata of the step it was captured in, so the piecewise runner captures only
what lies between them: this module finds them by namespace and tag, and cuts the graph into
pieces (captured) and op groups (run eagerly every step), in their original order.

One exception when the pieces are captured: a DECODER layer's cache write reads nothing of the
step but its slot mapping, which the piecewise graphs keep in a static buffer of each bucket
(pads -1) and fill every step. Such a write stays inside its piece (`is_captured_write`), and
is replayed with it: one eager op a layer instead of two.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from compiled_attn.abstract import AttentionType
from compiled_attn.forward_context import get_layer

OP_NAMESPACE = "compiled_attn"


def is_context_op(node: fx.Node) -> bool:
    """A call of one of our ops that reads the forward context (found by namespace and tag, so a
    backend registered later is covered with no change here)."""
    if node.op != "call_function":
        return False
    target = _overload(node)
    return (isinstance(target, torch._ops.OpOverload) and target.namespace == OP_NAMESPACE
            and torch.Tag.cudagraph_unsafe in target.tags)


def is_captured_write(node: fx.Node) -> bool:
    """A cache write the piecewise graphs capture inside a piece: `kv_cache_update` of a DECODER
    layer outside any layer group (a cross-attention write reads the cross slots; a grouped
    layer, its group's slots: those stay eager)."""
    if not is_context_op(node) or _overload(node).name() != f"{OP_NAMESPACE}::kv_cache_update":
        return False
    call = get_layer(node.args[-1])
    return call.attn_type == AttentionType.DECODER and call.group is None


def is_eager_op(node: fx.Node) -> bool:
    """A context op the piecewise graphs run eagerly between captured pieces."""
    return is_context_op(node) and not is_captured_write(node)


def _overload(node: fx.Node) -> torch._ops.OpOverload:
    target = node.target
    return target.default if isinstance(target, torch._ops.OpOverloadPacket) else target


@dataclasses.dataclass
class Piece:
    """One submodule of the split graph, in execution order."""

    name: str  # its attribute on the split module: submod_<index>
    index: int
    is_op_group: bool  # True: a run of consecutive context ops (eager every step); False: captured
    module: fx.GraphModule


def split_at_context_ops(gm: fx.GraphModule, is_op: Callable[[fx.Node], bool] = is_context_op
                         ) -> tuple[fx.GraphModule, list[Piece]]:
    """`gm` cut before and after every run of consecutive ops that `is_op` picks (default: every
    context op; `is_eager_op` leaves the captured cache writes in the pieces).

    Returns the split module (calling its submodules in the original order) and its pieces,
    alternating captured pieces and op groups. `gm`'s node metadata (Dynamo's fake
    `example_value`s) is kept on the submodules' nodes.
    """
    part_of: dict[fx.Node, int] = {}
    op_parts: set[int] = set()
    part, used = 0, False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if (node.op == "call_function" and node.target is operator.getitem and node.args[0] in part_of
                and isinstance(node.args[0].meta.get("example_value"), tuple | list | torch.Size)):
            # A tuple (or torch.Size) never crosses a cut: its getitems stay with what made it. A
            # tensor's getitem is a read like any other: it stays where it was, after any op
            # that writes the tensor.
            part_of[node] = part_of[node.args[0]]
            continue
        op = is_op(node)
        if used and op != (part in op_parts):
            part, used = part + 1, False
        if op:
            op_parts.add(part)
        part_of[node], used = part, True
    # keep_original_order: the ops mutate their arguments (the cache, `output`), so every node
    # must run where it was.
    split = split_module(gm, None, lambda node: part_of[node], keep_original_order=True)
    pieces = [Piece(name, int(name.removeprefix("submod_")), int(name.removeprefix("submod_")) in op_parts, module)
              for name, module in split.named_children()]
    pieces.sort(key=lambda p: p.index)
    return split, pieces

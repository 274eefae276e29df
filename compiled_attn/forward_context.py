"""How metadata and per-layer constants reach the ops without passing through Dynamo.

Metadata holds python ints that change every step; passed through Dynamo they would cause
recompiles. Our ops read it from a context set around each model step: a `contextvars.ContextVar`,
so each thread and each asyncio task sees its own (two models served from one process on two
threads never read each other's metadata), restored on every exit from the block.

Several layer groups (layers planned differently, e.g. sliding-window and full layers) share one
forward: the context then holds a `groups.GroupedMetadata` and each op reads its layer's group
(`LayerCall.group`, set by `ca.Attention(group=...)`).

Per-layer constants (scale, window, soft-cap, ALiBi slopes, k/v scales) reach the ops through a
layer registry: the op gets the layer's name, a string Dynamo treats as a constant. (Floats
passed as op arguments become symbolic inputs under `dynamic=True` and cost a `.item()` each.)
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from compiled_attn.abstract import AttentionImpl, AttentionMetadata, AttentionType
from compiled_attn.groups import GroupedMetadata
from compiled_attn.validation import CheckedKind, StepFacts

T = TypeVar("T")


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata  # one builder's, or a GroupedMetadata of one per layer group
    # What ops derive from the metadata once per forward and share across layers (`derived`)
    _derived: dict[Hashable, Any] = field(default_factory=dict, repr=False)
    # What the ops' checks read of each group's metadata, once per forward (`step_facts`)
    _steps: dict[str | None, StepFacts] = field(default_factory=dict, repr=False)

    def derived(self, key: Hashable, make: Callable[[], T]) -> T:
        """`make()` the first time `key` is asked for in this context, the same object after: for
        tensors every layer of a step would otherwise recompute from the metadata (the key names
        what they depend on)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def metadata_for(self, group: str | None) -> AttentionMetadata:
        """What a layer of `group` reads: its group's metadata, or the one metadata (which serves
        every layer, grouped or not, when the step has a single group)."""
        md = self.attn_metadata
        return md.for_group(group) if isinstance(md, GroupedMetadata) else md

    def step_facts(self, group: str | None) -> StepFacts:
        """`metadata_for(group)` with what every op checks of it (`validation.StepFacts`), read by
        the first op of the forward that asks and kept for the others."""
        step = self._steps.get(group)
        if step is None:
            step = self._steps[group] = StepFacts(self.metadata_for(group))
        return step


@dataclass
class PieceCapture(AttentionMetadata):
    """The forward context while piecewise graphs warm up and capture one token bucket: no step,
    only the static slot buffer of that bucket (all pads, -1). A DECODER layer's cache write is
    captured inside a piece (`graphs.split.is_captured_write`) and reads that buffer at every
    replay; the graphs fill it with each step's slots. The attention ops are skipped here."""

    @property
    def prefill_metadata(self) -> None:
        return None

    @property
    def decode_metadata(self) -> None:
        return None


@contextmanager
def capturing_pieces(slot_mapping: torch.Tensor) -> Iterator[ForwardContext]:
    """The forward context of a piecewise capture whose cache writes read `slot_mapping`."""
    md = PieceCapture(num_prefills=0, num_prefill_tokens=0, num_decode_tokens=slot_mapping.shape[0],
                      slot_mapping=slot_mapping)
    with _entered(ForwardContext(md)) as context:
        yield context


_forward_context: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "compiled_attn_forward_context", default=None
)


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | Mapping[str, AttentionMetadata],
) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every attention op run inside the block, in this thread
    (or asyncio task) only; the previous context comes back however the block exits.

    `attn_metadata`: a builder's metadata, or (several layer groups) a `GroupedMetadata` or a
    {group name: metadata} dict, each layer reading its own group's.

    Example::

        with ca.set_forward_context(md):
            logits = compiled_model(input_ids, positions, kv_caches)
    """
    if isinstance(attn_metadata, Mapping):
        attn_metadata = GroupedMetadata.of(attn_metadata)
    if not isinstance(attn_metadata, AttentionMetadata):
        raise ValueError(
            f"set_forward_context needs AttentionMetadata from a builder, got {type(attn_metadata)}"
        )
    with _entered(ForwardContext(attn_metadata)) as context:
        yield context


@contextmanager
def _entered(context: ForwardContext) -> Iterator[ForwardContext]:
    token = _forward_context.set(context)
    try:
        yield context
    finally:
        _forward_context.reset(token)


def get_forward_context() -> ForwardContext:
    """The current thread's (or task's) context; RuntimeError outside `set_forward_context`."""
    context = _forward_context.get()
    if context is None:
        raise RuntimeError(
            "compiled_attn attention ran outside set_forward_context: wrap the model call in "
            "`with compiled_attn.set_forward_context(attn_metadata):`"
        )
    return context


@dataclass(frozen=True, eq=False)
class LayerCall:
    """What an op needs to know about the layer calling it, besides tensors and metadata.

    `checked_kinds`: the kinds of call whose static checks this layer passed, latest first
    (`validation.check_layer_call`), so that its ops check only the per-step rest.
    `group`: the layer group whose metadata the ops read from a grouped forward context.
    """

    impl: AttentionImpl
    k_scale: float
    v_scale: float
    attn_type: AttentionType
    group: str | None = None
    checked_kinds: list[CheckedKind] = field(default_factory=list, repr=False)


# name -> the layer, weakly (a WeakValueDictionary's lookup costs 3x a dict's and a call, per op)
_layers: dict[str, weakref.ref[LayerCall]] = {}
# per name prefix (impl class and attention type): the next new id, and the ids of dead layers
_next_ids: dict[str, itertools.count] = {}
_free_ids: dict[str, list[int]] = {}


def register_layer(call: LayerCall) -> str:
    """Register `call` under a name unique among live layers; the caller keeps `call` alive
    (weakly held here: the name goes when the record dies).

    Names are "<impl class>.<attention type>.<n>" with n the smallest id no live layer of that
    prefix holds: a model built after others were dropped gets the names a fresh process would
    give it. Compiled graphs hold the names as constants, so Inductor's caches (whose keys
    include them) then serve a later run or a rebuilt model, where ever-growing ids missed."""
    prefix = f"{type(call.impl).__name__}.{call.attn_type.value}"
    free = _free_ids.setdefault(prefix, [])
    try:
        n = heapq.heappop(free)
    except IndexError:  # none free: a new id (this also covers a racing registration)
        n = next(_next_ids.setdefault(prefix, itertools.count()))
    name = f"{prefix}.{n}"

    def release(_: weakref.ref, name: str = name, n: int = n) -> None:
        _layers.pop(name, None)
        heapq.heappush(free, n)

    _layers[name] = weakref.ref(call, release)
    return name


def get_layer(name: str) -> LayerCall:
    """The registered layer `name`; RuntimeError if it was garbage-collected or never made."""
    ref = _layers.get(name)
    call = None if ref is None else ref()
    if call is None:
        raise RuntimeError(
            f"no attention layer named {name!r} is alive: ops take the name of a live "
            "compiled_attn.Attention (or AttentionImpl) layer"
        )
    return call

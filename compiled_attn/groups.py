"""Several layer groups in one forward: one metadata (and one graph State) per group.

Layers whose attention is planned alike — same heads, head size, scale, window, soft-cap — form
a group with one `AttentionSpec`, one builder and one cache geometry. A model whose layers differ
(Gemma2's alternating windows, Qwen2's `max_window_layers`) has several groups in one forward:
each group's builder plans its own step (FlashInfer bakes window, soft-cap and scale into its
plan), and `GroupedMetadata` carries them all through the forward context; each op picks its
layer's group (`ca.Attention(group=...)`). `GroupedState` does the same for CUDA-graph States,
so `CUDAGraphRunner` captures such a model with no change: it sees one metadata and one State.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from compiled_attn.abstract import AttentionMetadata, AttentionState
from compiled_attn.graph_state import GraphState

_SEP = "/"  # group name / field name in the flat buffer dict a runner keeps


class _FirstGroupField:
    """A step-level device field, the first group's, read when asked: a builder's metadata uploads
    at its first device-field read (`metadata.DeviceField`), which a graph step never makes."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, md: GroupedMetadata | None, owner: type | None = None) -> Any:
        if md is None:
            raise AttributeError(self.name)  # no default: the dataclass field stays required
        return getattr(md.first, self.name)


@dataclasses.dataclass(eq=False)
class GroupedMetadata(AttentionMetadata):
    """One step described for several layer groups: `groups[name]` is the metadata that group's
    builder made for the step (the same requests, lengths and order in every group; each
    group's own block tables). The step-level fields (`num_prefills`, token counts,
    `slot_mapping` of the first group) let runners treat it as one metadata.

    Example::

        md = GroupedMetadata.of({"full": full_builder.build(seq_lens, query_lens, full_tables),
                                 "sliding": swa_builder.build(seq_lens, query_lens, swa_tables)})
        with ca.set_forward_context(md):      # or set_forward_context({...}) with the dict
            logits = model(input_ids, positions, kv_caches)
    """

    slot_mapping: torch.Tensor | None = _FirstGroupField()  # None: the first group's (`of`)
    groups: dict[str, AttentionMetadata] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.__dict__.get("slot_mapping") is None:  # `of`'s: the first group's when read
            del self.__dict__["slot_mapping"]

    @classmethod
    def of(cls, groups: Mapping[str, AttentionMetadata]) -> GroupedMetadata:
        """ValueError unless `groups` maps names to metadata of one backend and one step."""
        if not isinstance(groups, Mapping) or not groups:
            raise ValueError("GroupedMetadata needs a non-empty {group name: metadata} mapping")
        items = list(groups.items())
        first_name, first = items[0]
        for name, md in items:
            if not isinstance(name, str) or not isinstance(md, AttentionMetadata) or isinstance(md, GroupedMetadata):
                raise ValueError(f"group {name!r}: set_forward_context / GroupedMetadata take AttentionMetadata from "
                                 f"a builder per group name, got {type(name).__name__} -> {type(md).__name__}")
            if _step_of(md) != _step_of(first):
                raise ValueError(f"groups {first_name!r} and {name!r} describe different steps "
                                 f"({_step_of(first)} vs {_step_of(md)}): build every group from the same "
                                 "seq_lens and query_lens")
            if getattr(md, "backend_name", None) != getattr(first, "backend_name", None):
                raise ValueError(f"groups {first_name!r} and {name!r} come from different backends: one forward "
                                 "runs one backend")
        return cls(num_prefills=first.num_prefills, num_prefill_tokens=first.num_prefill_tokens,
                   num_decode_tokens=first.num_decode_tokens, slot_mapping=None, groups=dict(items))

    @property
    def first(self) -> AttentionMetadata:
        return next(iter(self.groups.values()))

    # the step-level facts a runner reads, the same in every group
    @property
    def backend_name(self) -> str:
        return getattr(self.first, "backend_name", "")

    @property
    def num_seqs(self) -> int:
        return self.first.num_seqs

    @property
    def num_decodes(self) -> int:
        return self.first.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def max_seq_len(self) -> int:
        return self.first.max_seq_len

    @property
    def longest_seq_len(self) -> int:
        return self.first.longest_seq_len

    @property
    def prefill_metadata(self) -> GroupedMetadata | None:
        return self._view("prefill_metadata")

    @property
    def decode_metadata(self) -> GroupedMetadata | None:
        return self._view("decode_metadata")

    def _view(self, name: str) -> GroupedMetadata | None:
        views = {g: getattr(md, name) for g, md in self.groups.items()}
        return None if any(v is None for v in views.values()) else GroupedMetadata.of(views)

    def for_group(self, group: str | None) -> AttentionMetadata:
        """The metadata of `group`; ValueError naming the fix for a layer outside the groups."""
        if group is None:
            raise ValueError(f"the forward context holds metadata of layer groups {list(self.groups)}, but this "
                             "layer has no group: make it with ca.Attention(..., group=<its group>)")
        md = self.groups.get(group)
        if md is None:
            raise ValueError(f"this layer is in group {group!r}, the forward context's metadata has groups "
                             f"{list(self.groups)}: build one metadata per group of the model")
        return md


def _step_of(md: AttentionMetadata) -> tuple:
    """What must agree between the groups of one step."""
    return (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens,
            tuple(getattr(md, "seq_lens", ())), tuple(getattr(md, "query_lens", ())))


class GroupedState(AttentionState):
    """The CUDA-graph States of several layer groups as one State (docs/design.md, section 3):
    every call goes to each group's State with that group's metadata; input buffers are one flat
    dict keyed "group/field". The groups' States must declare the same full table width (same
    block_size and max_seq_len_to_capture); of the narrower widths, the graphs capture those
    every group's State declares. TORCH_SDPA's on CUDA differ so in a model with a sliding-window
    group: FlexAttention's decode (a full-attention group) declares the full width only, the
    gather (the window group) narrower ones too, so the window group then replays the full
    width's graphs. A warning says so.

    Example::

        state = GroupedState({g: backend.get_state_cls()(spec) for g, spec in specs.items()})
        runner = CUDAGraphRunner(model, backend, next(iter(specs.values())), kv_caches, state)
    """

    def __init__(self, states: Mapping[str, AttentionState]) -> None:
        if not isinstance(states, Mapping) or not states or not all(
                isinstance(s, AttentionState) for s in states.values()):
            raise ValueError("GroupedState needs a non-empty {group name: AttentionState} mapping")
        super().__init__(next(iter(states.values())).spec)
        self.states = dict(states)
        widths = {name: s.graph_table_widths() for name, s in self.states.items()}
        if len({max(w) for w in widths.values()}) > 1:
            raise ValueError(f"the groups' States capture different table widths {widths}: give every group's "
                             "spec one block_size and max_seq_len_to_capture")
        shared = set.intersection(*(set(w) for w in widths.values()))
        self._widths = tuple(sorted(shared, reverse=True))
        if any(len(w) > len(shared) for w in widths.values()):
            warnings.warn(f"the groups' States declare different block-table widths {widths}: the graphs capture "
                          f"the widths they share, {list(self._widths)} (steps of a group whose State has more "
                          "replay a wider graph than it needs)", stacklevel=2)

    def graph_table_widths(self) -> tuple[int, ...]:
        return self._widths

    @contextmanager
    def graph_capture(self, max_batch_size: int) -> Iterator[None]:
        with ExitStack() as stack:
            for state in self.states.values():
                stack.enter_context(state.graph_capture(max_batch_size))
            yield

    def graph_capture_get_metadata_for_batch(self, batch_size: int, *, table_width: int | None = None
                                             ) -> GroupedMetadata:
        kw = {} if table_width is None else {"table_width": table_width}
        return GroupedMetadata.of({g: s.graph_capture_get_metadata_for_batch(batch_size, **kw)
                                   for g, s in self.states.items()})

    def graph_clone(self, batch_size: int, *, table_width: int | None = None) -> GroupedState:
        kw = {} if table_width is None else {"table_width": table_width}
        clone = copy.copy(self)  # a copy, not a new State: the widths were checked (and warned of) once
        clone.states = {g: s.graph_clone(batch_size, **kw) for g, s in self.states.items()}
        return clone

    def get_graph_input_buffers(self, attn_metadata: AttentionMetadata) -> dict[str, torch.Tensor]:
        md = _grouped(attn_metadata)
        return {f"{g}{_SEP}{name}": t for g, s in self.states.items()
                for name, t in s.get_graph_input_buffers(md.for_group(g)).items()}

    def prepare_graph_input_buffers(self, input_buffers: dict[str, torch.Tensor],
                                    attn_metadata: AttentionMetadata, *, upload: bool = True) -> None:
        md = _grouped(attn_metadata)
        # upload=False only after every group's upload was captured (upload_graph_input_buffers)
        kw, per_group = ({} if upload else {"upload": False}), self._per_group(input_buffers)
        steps = {g: md.for_group(g) for g in self.states}
        if all(type(state).prepare_graph_input_buffers is GraphState.prepare_graph_input_buffers
               for state in self.states.values()):  # a State that overrides it gets its own call
            # every group's step checked before any group's buffers are written: a step one group
            # refuses leaves them all as they were
            for g, state in self.states.items():
                state._check_step(steps[g], per_group[g], per_group[g]["slot_mapping"].shape[0])
            for g, state in self.states.items():
                state._refill(per_group[g], steps[g], **kw)
            return
        for g, state in self.states.items():  # another State checks and writes in one call
            state.prepare_graph_input_buffers(per_group[g], steps[g], **kw)

    def upload_graph_input_buffers(self, input_buffers: dict[str, torch.Tensor]) -> bool:
        # every group's, even where one does not capture: an upload queued twice writes the same bytes
        per_group = self._per_group(input_buffers)
        return all([state.upload_graph_input_buffers(per_group[g]) for g, state in self.states.items()])

    def _per_group(self, input_buffers: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        per_group: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in input_buffers.items():
            g, _, name = key.rpartition(_SEP)  # group names may hold the separator; field names never do
            per_group.setdefault(g, {})[name] = t
        if per_group.keys() != self.states.keys():  # another state's groups, or some of its own missing
            raise RuntimeError(f"these buffers are not this state's (groups {sorted(per_group)}, this state's "
                               f"{sorted(self.states)}): prepare a graph's buffers through the clone of the state "
                               "whose get_graph_input_buffers gave them")
        return per_group

    def begin_forward(self, attn_metadata: AttentionMetadata) -> None:
        md = _grouped(attn_metadata)
        for g, state in self.states.items():
            state.begin_forward(md.for_group(g))


def _grouped(md: object) -> GroupedMetadata:
    if not isinstance(md, GroupedMetadata):
        raise ValueError(f"a GroupedState serves GroupedMetadata (one metadata per group), got {type(md).__name__}")
    return md

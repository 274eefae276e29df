"""The CUDA-graph State every backend shares: static buffers, capture lifecycle, pad rows.

A captured decode graph reads fixed addresses, so `GraphState` allocates each per-request input
once, for the largest batch size, and the graph of batch size bs reads rows [:bs] of it. Each
step, `prepare_graph_input_buffers` copies a decode-only step into those rows and makes the rest
pad rows; `begin_forward` runs whatever host planning the backend needs before the replay.

A backend's State subclasses `GraphState`, sets `backend_cls` and overrides only hooks:

- `allocate_extra` / `add_graph_fields`: its own static inputs and the metadata fields over them;
- `ROW_PADS` / `TABLES`: which of those inputs are per-request rows / block tables (copied and
  padded here), `host_rows` for the live values of the rows, `copy_extra` for inputs of another
  layout (FlashInfer's page list);
- `make_for_batch` / `plan`: an object per captured batch size (FlashInfer's graph wrapper) and
  the host planning before each replay;
- `MIN_TABLE_WIDTH_TOKENS`: graphs of narrower block tables too, for a kernel whose work grows
  with the table's width rather than the live lengths (TORCH_SDPA's gather): `graph_table_widths`.

Which specs a State captures is data on the backend class (`graph_attn_types`,
`graph_supports_alibi`, next to its other capabilities, checked in `capabilities.capability_reason`).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch

from compiled_attn.abstract import AttentionBackend, AttentionSpec, AttentionState
from compiled_attn.capabilities import capability_reason, spec_needs
from compiled_attn.metadata import CommonMetadata, aligned_offsets
from compiled_attn.registry import backends_with
from compiled_attn.validation import as_int, check_graph_step

SCRATCH_BLOCK = 0  # pad rows read one token of this block: any block is valid to read, and they write nothing
# Ranges of the static buffers a graph reads are copied as one when the bytes between them (rows
# of larger batch sizes) are at most this many: ~1 us of PCIe time, less than a copy call's ~5 us
# of host time.
MERGE_GAP_BYTES = 64 << 10


class StaticInputs:
    """Every static buffer of a State as a view of one device byte buffer, with a host mirror
    of the same layout (pinned on CUDA).

    A step writes its rows and pads into the mirror with numpy, then `upload` moves the ranges
    a graph reads with one host-to-device copy per range (one for most layouts): a copy and a
    fill per field instead cost ~5-10 us of host time each on a GPU. Before the mirror is
    written again, `wait_uploaded` waits for the GPU to have read the last upload: an async copy
    from pinned memory reads it when it runs, not when it is queued.
    """

    def __init__(self, parts: dict[str, torch.Tensor], pads: dict[str, int]) -> None:
        """parts: each buffer with its initial values; pads: what a pad row holds, for the
        buffers of per-request rows (their every row starts as a pad)."""
        device = next(iter(parts.values())).device
        # the per-request rows before the tables, so that the rows a graph reads sit close together;
        # every view starts aligned (metadata.UPLOAD_ALIGN)
        order = sorted(parts, key=lambda name: (-parts[name].element_size(), parts[name].numel()))
        offsets, total = aligned_offsets({name: parts[name].numel() * parts[name].element_size() for name in order})
        cuda = device.type == "cuda"
        self._device_bytes = torch.empty(total, dtype=torch.uint8, device=device)
        self._host_bytes = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
        self.views: dict[str, torch.Tensor] = {}  # device, keyed by the metadata field that views them
        self.host: dict[str, np.ndarray] = {}  # the mirror's views, same keys
        for name in parts:
            part, start = parts[name], offsets[name]
            span = slice(start, start + part.numel() * part.element_size())
            self.views[name] = self._device_bytes[span].view(part.dtype).view(part.shape)
            host = self._host_bytes[span].view(part.dtype).view(part.shape)
            host.copy_(part)
            self.host[name] = host.numpy()
            if name in pads:
                self.host[name][:] = pads[name]
        self._device_bytes.copy_(self._host_bytes)
        self.live_rows = 0  # rows from here on hold pads in every ROW_PADS / TABLES mirror
        # external: recorded inside a capture, it becomes a node of the graph (`upload` captured
        # there records it at every replay) instead of a dependency between captured streams
        self._uploaded = torch.cuda.Event(external=True) if cuda else None
        # (device, mirror) byte ranges per graph; on CPU numpy's copy: torch copies more than
        # 32K elements with its thread pool, which costs milliseconds on a busy host
        self._copies: dict[tuple[int, int], list[tuple[Any, Any]]] = {}
        self._copy = _copy_to_device if cuda else np.copyto

    def wait_uploaded(self) -> None:
        """The GPU has read the mirror's last upload (at once when it has: it runs before the
        replay that the host prepared before this step)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def upload(self, key: tuple[int, int], bufs: dict[str, torch.Tensor]) -> None:
        """The mirror's bytes under `bufs` (the views one graph reads, `key` naming them) to the
        device. Inside a graph's capture, the copies and the event become the graph's: each
        replay then reads the mirror as the host last wrote it."""
        if key not in self._copies:
            pairs = [(self._device_bytes[lo:hi], self._host_bytes[lo:hi])
                     for lo, hi in merged_ranges([_byte_range(t) for t in bufs.values()])]
            self._copies[key] = pairs if self._uploaded is not None else [(d.numpy(), h.numpy()) for d, h in pairs]
        for dst, src in self._copies[key]:
            self._copy(dst, src)
        if self._uploaded is not None:
            self._uploaded.record()


def _copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


def _byte_range(view: torch.Tensor) -> tuple[int, int]:
    """Bytes [start, end) of a (possibly strided) view of a byte buffer."""
    size = view.element_size()
    last = sum((n - 1) * stride for n, stride in zip(view.shape, view.stride(), strict=True))
    return view.storage_offset() * size, (view.storage_offset() + last + 1) * size


def merged_ranges(ranges: list[tuple[int, int]], gap: int = MERGE_GAP_BYTES) -> list[tuple[int, int]]:
    """Byte ranges, sorted, those at most `gap` bytes apart merged into one.

    >>> merged_ranges([(100, 200), (0, 40), (50, 80)], gap=10)
    [(0, 80), (100, 200)]
    """
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class GraphState(AttentionState):
    """Static decode buffers and the capture / replay lifecycle of docs/design.md, for every backend.

    Buffers (on the spec's device; W = ceil(max_seq_len_to_capture / block_size)), keyed by the
    metadata field that views them; the graph of batch size bs reads rows [:bs]:

        slot_mapping:        int64 [max_batch_size]
        seq_lens_tensor:     int32 [max_batch_size]
        context_lens_tensor: int32 [max_batch_size]
        query_start_loc:     int32 [max_batch_size + 1], always arange (one token per decode)
        block_tables:        int32 [max_batch_size, W]
        + the backend's own (`allocate_extra`)

    Pad rows (n..bs-1 of a step of n live decodes, and every row while capturing) write nothing
    (slot -1) and read one token (seq_len 1) of SCRATCH_BLOCK: valid for every kernel whatever
    the cache holds; their outputs are discarded.

    Table widths: a State whose `MIN_TABLE_WIDTH_TOKENS` is set also captures, per batch size,
    graphs whose block table is a narrower view `block_tables[:bs, :width]` of the same buffer
    (`graph_table_widths()`, `table_width=` in the metadata and clone calls); a step whose
    longest table fits `width` blocks can be refilled into that view. Every other buffer is the
    same for every width.

    Example (docs/design.md, section 3, gives the full call order)::

        state = backend.get_state_cls()(spec)
        with state.graph_capture(max_batch_size=8):
            md_bs = state.graph_capture_get_metadata_for_batch(8)
            bufs = state.get_graph_input_buffers(md_bs)
            graph_state = state.graph_clone(8)
            ...  # warm up, capture the step under set_forward_context(md_bs)
        graph_state.prepare_graph_input_buffers(bufs, md)  # md: decode-only, <= 8 requests
        graph_state.begin_forward(md)
        graph.replay()
    """

    backend_cls: ClassVar[type[AttentionBackend]]
    # Per-request rows a step copies, and what a pad row holds: slot -1 (the cache write skips
    # it), seq_len 1 and no context (one key read, of SCRATCH_BLOCK: finite, discarded output).
    ROW_PADS: ClassVar[dict[str, int]] = {"slot_mapping": -1, "seq_lens_tensor": 1, "context_lens_tensor": 0}
    # Block tables a step copies; their pad rows hold SCRATCH_BLOCK.
    TABLES: ClassVar[tuple[str, ...]] = ("block_tables",)
    # None: one graph per batch size, over the full table (W blocks): kernels that read the live
    # lengths (FlashInfer's page list, xFormers' paged bias) gain nothing from a narrower one.
    # n: also graphs over the first m, 2m, 4m, ... < W columns of `block_tables`, m = ceil(n /
    # block_size), for kernels whose work grows with the table's width (`table_widths`).
    MIN_TABLE_WIDTH_TOKENS: ClassVar[int | None] = None
    # Whether the graphs decode through the kernel eager steps run: then their logits are eager's
    # but for rounding noise. A State whose graphs take another kernel sets it False (their greedy
    # tokens may then flip at bf16 near-ties: `compiled_attn.testing.agreement`).
    decodes_on_eager_kernel: bool = True

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.max_blocks_per_seq = -(-spec.max_seq_len_to_capture // spec.block_size)
        self._inputs: StaticInputs | None = None  # full size, shared by every clone
        # batch size -> what make_for_batch made for it; a clone holds its own size only
        self._slots: dict[int, Any] = {}
        self._made: set[tuple[int, int]] = set()  # (batch size, table width) of each metadata made
        self._capturing = False
        self._prepared: tuple[weakref.ref[CommonMetadata], int] | None = None  # the step begin_forward may plan

    @property
    def _buffers(self) -> dict[str, torch.Tensor] | None:
        """The static buffers, full size, keyed by the metadata field that views them."""
        return None if self._inputs is None else self._inputs.views

    # -- capture ---------------------------------------------------------------------------

    @contextmanager
    def graph_capture(self, max_batch_size: int) -> Iterator[None]:
        """Allocate the static buffers for up to `max_batch_size` decodes (once; reused while big enough).

        NotImplementedError for a spec this backend's graphs cannot capture (naming backends that
        can), ValueError for max_batch_size < 1, RuntimeError inside a CUDA-graph capture.
        """
        self._check_capturable()
        max_batch_size = as_int("max_batch_size", max_batch_size)
        self._forbid_stream_capture("graph_capture")
        if self._buffers is None or self._buffers["slot_mapping"].shape[0] < max_batch_size:
            self._inputs = self._allocate(max_batch_size)
            self._slots, self._made = {}, set()  # made over the old buffers (clones keep theirs)
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def _check_capturable(self) -> None:
        spec = self.spec
        needs: dict[str, Any] = dict(attn_type=spec.attn_type, block_size=spec.block_size,
                                     alibi=spec.alibi_slopes is not None, graphs=True)
        reason = capability_reason(self.backend_cls, **needs)
        if reason is not None:
            others = backends_with(**spec_needs(spec), graphs=True)  # ones that serve all of the spec
            raise NotImplementedError(f"{reason}; " + (f"use {' or '.join(others)}" if others else
                                                      "run these steps eagerly"))

    def _forbid_stream_capture(self, what: str) -> None:
        if self.spec.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.backend_cls.get_name()}: call {what} before capturing a graph, not inside")

    def _allocate(self, max_batch_size: int) -> StaticInputs:
        dev, n, i32 = self.spec.device, max_batch_size, torch.int32
        return StaticInputs({
            "slot_mapping": torch.full((n,), -1, dtype=torch.int64, device=dev),
            "seq_lens_tensor": torch.ones(n, dtype=i32, device=dev),
            "context_lens_tensor": torch.zeros(n, dtype=i32, device=dev),
            "query_start_loc": torch.arange(n + 1, dtype=i32, device=dev),
            "block_tables": torch.full((n, self.max_blocks_per_seq), SCRATCH_BLOCK, dtype=i32, device=dev),
            **self.allocate_extra(max_batch_size),
        }, self._row_pads())

    def graph_table_widths(self) -> tuple[int, ...]:
        """The block-table widths (blocks) of the graphs captured per batch size, largest first:
        the full W, plus narrower ones where MIN_TABLE_WIDTH_TOKENS is set."""
        return table_widths(self.max_blocks_per_seq, self.spec.block_size, self.MIN_TABLE_WIDTH_TOKENS)

    def graph_capture_get_metadata_for_batch(self, batch_size: int, *, table_width: int | None = None
                                             ) -> CommonMetadata:
        """All-pad decode metadata of `batch_size` rows whose tensors are views of the static
        buffers, its block table the first `table_width` columns (one of `graph_table_widths()`;
        None: all W)."""
        if not self._capturing or self._buffers is None:
            raise RuntimeError(
                "call graph_capture_get_metadata_for_batch inside `with state.graph_capture(max_batch_size):`"
            )
        self._forbid_stream_capture("graph_capture_get_metadata_for_batch")
        batch_size = as_int("batch_size", batch_size, minimum=None)
        top = self._buffers["slot_mapping"].shape[0]
        if not 1 <= batch_size <= top:
            raise ValueError(f"batch_size={batch_size} outside 1..{top} (graph_capture's maximum)")
        width = self._table_width(table_width)
        if batch_size not in self._slots:
            self._slots[batch_size] = self.make_for_batch(batch_size)
        self._made.add((batch_size, width))
        md = self._pad_metadata(batch_size, width)
        self._write_step(self.get_graph_input_buffers(md), None)  # warm-up and capture must write nothing
        self.plan(None, batch_size)
        return md

    def _table_width(self, table_width: int | None) -> int:
        """The width `table_width` names (None: the full W), checked against the declared ones."""
        if table_width is None:
            return self.max_blocks_per_seq
        width, widths = as_int("table_width", table_width), self.graph_table_widths()
        if width not in widths:
            raise ValueError(f"table_width={width} is not a width this {self.backend_cls.get_name()} state captures "
                             f"(graph_table_widths(): {list(widths)} blocks)")
        return width

    def _pad_metadata(self, n: int, width: int) -> CommonMetadata:
        # Host fields are fixed per batch size and width (the ops read num_prefills = 0 and
        # num_decodes = n); the per-step lengths live in the device views only.
        b, spec = self._buffers, self.spec
        md = self.backend_cls.get_metadata_cls()(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=n, slot_mapping=b["slot_mapping"][:n],
            seq_lens=[1] * n, query_lens=[1] * n, block_tables_list=[[SCRATCH_BLOCK]] * n, max_query_len=1,
            max_seq_len=min(spec.max_seq_len_to_capture, width * spec.block_size),
            seq_lens_tensor=b["seq_lens_tensor"][:n], context_lens_tensor=b["context_lens_tensor"][:n],
            query_start_loc=b["query_start_loc"][: n + 1], block_tables=b["block_tables"][:n, :width],
            backend_name=self.backend_cls.get_name(), block_size=spec.block_size, num_blocks=spec.num_blocks,
            spec=spec,
        )
        self.add_graph_fields(md, n)
        return md

    def get_graph_input_buffers(self, attn_metadata: CommonMetadata) -> dict[str, torch.Tensor]:
        """The static views `attn_metadata` (from graph_capture_get_metadata_for_batch) is made of,
        keyed by field name."""
        if self._buffers is None:
            raise RuntimeError("get_graph_input_buffers before graph_capture allocated the buffers")
        return {name: getattr(attn_metadata, name) for name in self._buffers}

    def graph_clone(self, batch_size: int, *, table_width: int | None = None) -> GraphState:
        """A state for the graph of `batch_size` (and `table_width`): shares the static buffers
        and owns what graph_capture_get_metadata_for_batch(batch_size) made, keeping both alive."""
        batch_size = as_int("batch_size", batch_size)
        width = self._table_width(table_width)
        if (batch_size, width) not in self._made:
            args = f"{batch_size}" if table_width is None else f"{batch_size}, table_width={width}"
            raise RuntimeError(f"graph_clone({args}) before graph_capture_get_metadata_for_batch({args})")
        # a copy, not a new State: what a backend resolved when the State was made (FlashInfer's
        # decode kernel) holds for its clones, whatever the environment says by now
        clone = copy.copy(self)
        clone._slots = {batch_size: self._slots[batch_size]}
        clone._made = {(batch_size, width)}
        clone._capturing, clone._prepared = False, None
        return clone

    # -- each step -------------------------------------------------------------------------

    def prepare_graph_input_buffers(
        self, input_buffers: dict[str, torch.Tensor], attn_metadata: CommonMetadata, *, upload: bool = True
    ) -> None:
        """Copy a decode-only step of n <= bs requests into the buffers of the graph of size bs;
        rows n.. become pads.

        The step's rows come from md's host fields (the lists and tables its device tensors were
        built from), written with its pads into a host mirror of the buffers and copied to them
        in one host-to-device copy per merged byte range (usually one) on the current stream
        (ordered before the replay). No sync, unless the GPU has not yet read the previous step's
        copy. upload=False writes the mirror only, for a graph that copies it itself: one whose
        capture began with `upload_graph_input_buffers(input_buffers)` (CUDAGraphRunner's do),
        which saves the copy's host calls each step.
        ValueError for a step the graph cannot serve (prefills, n > bs, a sequence longer than
        spec.max_seq_len_to_capture, metadata of another backend, cache size or device, or without
        an input the graph reads); RuntimeError for buffers of a size this state did not capture,
        or of another state.
        """
        self._check_step(attn_metadata, input_buffers, input_buffers["slot_mapping"].shape[0])
        self._refill(input_buffers, attn_metadata, upload)

    def _refill(self, bufs: dict[str, torch.Tensor], md: CommonMetadata, upload: bool = True) -> None:
        """A checked step (`_check_step`) into the buffers: what prepare_graph_input_buffers writes.
        `GroupedState` checks every group's step first, then refills each."""
        self._write_step(bufs, md, upload)
        # weak: a clone per batch size would otherwise keep its last step's metadata (and the
        # device buffer its fields view) alive until that size replays again
        self._prepared = (weakref.ref(md), bufs["slot_mapping"].shape[0])

    def _check_step(self, md: CommonMetadata, bufs: dict[str, torch.Tensor], batch_size: int) -> None:
        name = self.backend_cls.get_name()
        if self._buffers is None or bufs["slot_mapping"].data_ptr() != self._buffers["slot_mapping"].data_ptr():
            raise RuntimeError("these buffers are not this state's: prepare a graph's buffers through the clone of "
                               "the state whose get_graph_input_buffers gave them")
        if not isinstance(md, self.backend_cls.get_metadata_cls()):
            raise ValueError(f"{name} graphs replay metadata from {name}'s builder, got {type(md).__name__}")
        check_graph_step(md, self.spec, name, batch_size, bufs["slot_mapping"].device)
        if batch_size not in self._slots:
            raise RuntimeError(f"these are the buffers of batch size {batch_size}, which this state did not "
                               f"capture: prepare them through graph_clone({batch_size})'s state")
        width = bufs["block_tables"].shape[1]
        if (batch_size, width) not in self._made:
            raise RuntimeError(f"these are the buffers of batch size {batch_size} and table width {width}, which "
                               f"this state did not capture: prepare them through graph_clone({batch_size}, "
                               f"table_width={width})'s state")
        for field, buf in bufs.items():
            if not md.has(field):  # `has`, and the host tables below: no upload (the replay reads host arrays)
                raise ValueError(f"the graph reads {field}, which this metadata lacks: build it for the graph's spec "
                                 "(cross attention needs encoder_seq_lens and cross_block_tables)")
            if field in self.TABLES and (width := getattr(md, f"{field}_host").shape[1]) > buf.shape[1]:
                raise ValueError(f"{field} of {width} blocks per request > the graph's {buf.shape[1]}: "
                                 f"replay the step in a graph whose table_width holds it ({name}'s builder "
                                 "makes the table as wide as the step's longest sequence needs)")

    def _write_step(self, bufs: dict[str, torch.Tensor], md: CommonMetadata | None, upload: bool = True) -> None:
        """md's rows into the buffers of one batch size, pads after them (only pads when md is
        None): written into the host mirror, then copied (`StaticInputs`) unless `upload` is
        False (the graph copies them)."""
        inputs, n = self._inputs, 0 if md is None else md.num_seqs
        host = inputs.host
        inputs.wait_uploaded()
        if md is not None:
            for field, rows in self.host_rows(md).items():
                host[field][:n] = rows
            for field in self.TABLES:
                if field in host:
                    table = getattr(md, f"{field}_host")
                    # Columns past a live row's width (to the graph's table_width) keep ids of
                    # earlier steps (or SCRATCH_BLOCK): valid blocks, and keys beyond seq_len never
                    # reach an output. Columns past table_width are not this graph's to read.
                    host[field][:n, : table.shape[1]] = table
        if n < inputs.live_rows:  # rows of an earlier, larger step become pads; others hold pads already
            for field, pad in self._row_pads().items():
                if field in host:
                    host[field][n : inputs.live_rows] = pad
        inputs.live_rows = n
        batch_size = bufs["slot_mapping"].shape[0]
        self.copy_extra(host, md, batch_size)
        if upload:
            self._upload(bufs)

    def upload_graph_input_buffers(self, input_buffers: dict[str, torch.Tensor]) -> bool:
        """Copy the host mirror's bytes under `input_buffers` (one graph's, from
        get_graph_input_buffers) to them, in one host-to-device copy for most layouts.

        Called first inside a graph's capture, the copy becomes the graph's first node: every
        replay uploads what the last `prepare_graph_input_buffers(..., upload=False)` wrote,
        with no host call. The mirror is not written again until the GPU has read it."""
        self._upload(input_buffers)
        return True

    def _upload(self, bufs: dict[str, torch.Tensor]) -> None:
        self._inputs.upload((bufs["slot_mapping"].shape[0], bufs["block_tables"].shape[1]), bufs)

    def _row_pads(self) -> dict[str, int]:
        """What a pad row holds in each ROW_PADS and TABLES buffer (those a state allocates)."""
        return {**self.ROW_PADS, **dict.fromkeys(self.TABLES, SCRATCH_BLOCK)}

    def begin_forward(self, attn_metadata: CommonMetadata) -> None:
        """Host-side planning for the replay of the step just prepared (outside any graph)."""
        if self._prepared is None or self._prepared[0]() is not attn_metadata:
            raise RuntimeError("call prepare_graph_input_buffers(bufs, md) before begin_forward(md)")
        self.plan(attn_metadata, self._prepared[1])

    # -- hooks -----------------------------------------------------------------------------

    def allocate_extra(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        """The backend's own static inputs for up to `max_batch_size` decodes, keyed by the metadata
        field that views them (`add_graph_fields` sets those views)."""
        return {}

    def make_for_batch(self, batch_size: int) -> Any:
        """What the graph of `batch_size` needs besides the buffers, made once per size at capture
        and owned by its clone."""
        return None

    def add_graph_fields(self, md: CommonMetadata, batch_size: int) -> None:
        """Set the backend's own fields of the all-pad metadata of `batch_size` rows."""

    def host_rows(self, md: CommonMetadata) -> dict[str, np.ndarray]:
        """The live rows of each ROW_PADS buffer this state allocated, from md's host arrays (a
        decode-only step: one slot per request)."""
        host = md.host_arrays()
        return {name: host[name] for name in ("slot_mapping", "seq_lens_tensor", "context_lens_tensor")}

    def copy_extra(self, host: dict[str, np.ndarray], md: CommonMetadata | None, batch_size: int) -> None:
        """Write md's rows and the pads of `batch_size` rows into the host mirrors of inputs that
        are neither ROW_PADS rows nor TABLES (only pads when md is None)."""

    def plan(self, md: CommonMetadata | None, batch_size: int) -> None:
        """Host planning for the graph of `batch_size` over the prepared buffers (all pads when md
        is None, at capture)."""


def table_widths(max_blocks: int, block_size: int, min_tokens: int | None) -> tuple[int, ...]:
    """Block-table widths to capture, largest first: `max_blocks` and, when `min_tokens` is set,
    m, 2m, 4m, ... below it, m = ceil(min_tokens / block_size) blocks. Doubling keeps a step's
    table within twice its longest need (above m) with a graph count logarithmic in W.

    >>> table_widths(64, 16, 256)
    (64, 32, 16)
    >>> table_widths(10, 4, None)
    (10,)
    """
    widths = [max_blocks]
    if min_tokens is not None:
        width = -(-min_tokens // block_size)
        while width < max_blocks:
            widths.append(width)
            width *= 2
    return tuple(sorted(widths, reverse=True))

"""Builder logic every backend shares: validation, slot mapping, block tables, query_start_loc.

All of it runs on the host over python lists and numpy, then moves to the device in one copy
(`upload`), made when a device field of the step is first read (`DeviceField`). Backends subclass
`CommonMetadata` / `CommonMetadataBuilder` to add their own inputs (FlashInfer's indptr, SDPA's
padded gather indices, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from compiled_attn.abstract import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    AttentionType,
)
from compiled_attn.block_ids import BlockIdCheck
from compiled_attn.capabilities import capability_reason, spec_needs
from compiled_attn.registry import alternatives
from compiled_attn.validation import (
    CACHELESS_TYPES,
    check_block_ids,
    check_device_available,
    check_total,
    check_written_blocks,
    indexed_device,
    int_array,
    int_list,
    live_entries,
    needed_table,
    rolled_blocks,
)

# Held while a metadata uploads: another thread's first read of it waits, then finds the fields
# set (one lock for all, as uploads are one a step; an instance's would not pickle or deepcopy).
_UPLOAD_LOCK = threading.RLock()


def fake_mode_active() -> bool:
    """Whether a FakeTensorMode is active (a trace's): tensors made now would be fake."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class DeviceField:
    """A device tensor field of the metadata. A builder's step leaves these unset until the first
    read of any of them, which makes the step's one upload (`CommonMetadata.upload_pending`). A
    decode step replayed as a CUDA graph reads only the host arrays (its State writes them into
    the graph's pinned mirror), so it never pays for the upload: about a third of the common
    `build()` on an H200's host by cProfile (BENCHMARKS.md, thirtieth session).

    A dataclass field's descriptor (see the dataclasses docs; the class-level read gives the
    default, if any), and a non-data one: a set field is a plain instance attribute, so reading
    it costs what any attribute does (a data descriptor's call added ~100 ns to every read, a few
    hundred a step on the eager path). Python reaches `__get__` only for an unset field."""

    def __init__(self, default: Any = dataclasses.MISSING) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, md: CommonMetadata | None, owner: type | None = None) -> Any:
        if md is not None:
            md.upload_pending()
            if self.name in md.__dict__:
                return md.__dict__[self.name]
        if self.default is dataclasses.MISSING:
            raise AttributeError(self.name if md is None else f"{type(md).__name__}.{self.name} is unset (deleted?)")
        return self.default


@functools.cache
def _device_field_names(cls: type) -> frozenset[str]:
    """The fields `cls` declares as DeviceField (its own and inherited)."""
    return frozenset(name for klass in cls.__mro__ for name, attr in vars(klass).items()
                     if isinstance(attr, DeviceField))


@dataclasses.dataclass
class CommonMetadata(AttentionMetadata):
    """The fields every backend's metadata has.

    Host fields are python ints / lists (used by builders, states and bias objects, never by
    Dynamo). Device tensors:
        seq_lens_tensor:      int32 [num_seqs]
        context_lens_tensor:  int32 [num_seqs], seq_len - query_len (tokens already cached)
        query_start_loc:      int32 [num_seqs + 1], prefix sums of query_lens
        block_tables:         int32 [num_seqs, max_blocks_per_seq], each request's needed blocks
                              (ceil(seq_len / block_size)), padded with block 0; entries of a
                              request's table past its need are never copied here
        slot_mapping:         int64 [num_tokens], -1 = pad (writes nothing)
    Cross attention (encoder-decoder), present when encoder_seq_lens was given:
        encoder_seq_lens_tensor: int32 [num_seqs]
        encoder_seq_start_loc:   int32 [num_seqs + 1]
        cross_block_tables:      int32 [num_seqs, max_cross_blocks]
        cross_slot_mapping:      int64 [num_encoder_tokens of the prefills]; key/value hold the
                                 encoder tokens of the prefills on the step that has them
    A builder's device fields are uploaded together when one of them is first read
    (`DeviceField`); `has`, `is_uploaded` and `device` ask without uploading.
    Host copies the device tables were made from (what graph States check before a replay):
        block_tables_host / cross_block_tables_host: int32 numpy, the tables above
    Rolling tables (a builder made with rolling_tables=True, for a spec with a window W):
        rolled_blocks: int64 numpy [num_seqs], per request the leading blocks wholly before the
                       window of its first new token (position seq_len - query_len - W + 1):
                       ignored in the given table, block 0 in block_tables (masked by the
                       window), left out of FlashInfer's page list; None without rolling
    """

    slot_mapping: torch.Tensor = DeviceField()
    seq_lens: list[int]
    query_lens: list[int]
    block_tables_list: list[list[int]]
    max_query_len: int
    max_seq_len: int
    seq_lens_tensor: torch.Tensor = DeviceField()
    context_lens_tensor: torch.Tensor = DeviceField()
    query_start_loc: torch.Tensor = DeviceField()
    block_tables: torch.Tensor = DeviceField()
    encoder_seq_lens: list[int] | None = None
    cross_block_tables_list: list[list[int]] | None = None
    max_encoder_seq_len: int = 0
    num_encoder_tokens: int = 0
    encoder_seq_lens_tensor: torch.Tensor | None = DeviceField(None)
    encoder_seq_start_loc: torch.Tensor | None = DeviceField(None)
    cross_block_tables: torch.Tensor | None = DeviceField(None)
    cross_slot_mapping: torch.Tensor | None = DeviceField(None)
    backend_name: str = ""
    block_size: int = 0
    num_blocks: int = 0
    spec: AttentionSpec | None = None
    block_tables_host: np.ndarray | None = None
    cross_block_tables_host: np.ndarray | None = None
    rolled_blocks: np.ndarray | None = None
    # Per row of each host table, the entries build() checked (each request's need then; the
    # rest pad with block 0). A copy made by dataclasses.replace keeps them with the tables, so a
    # graph State can refuse replaced lengths that would read padding as blocks.
    block_tables_checked: np.ndarray | None = None
    cross_block_tables_checked: np.ndarray | None = None

    def __post_init__(self) -> None:
        self._views: dict[str, AttentionMetadata | None] = {}
        self._builder: CommonMetadataBuilder | None = None
        # `needed_block_ids()`: set by the builder (checked), else read on first use
        self._needed_block_ids: np.ndarray | None = None
        # the host arrays the device fields were copied from, by field name (`host_arrays()`):
        # backends' own host work and graph refills read them rather than deriving them again
        self._host: dict[str, np.ndarray] = {}
        # the arrays of the unset device fields and their device (`upload_pending`)
        self._pending: tuple[dict[str, np.ndarray], torch.device] | None = None

    def _defer_upload(self, arrays: dict[str, np.ndarray], device: torch.device) -> None:
        """Unset the DeviceFields `arrays` names until one of them is read: then one upload of
        `arrays` to `device` sets them all (`upload_pending`)."""
        for name in arrays:
            del self.__dict__[name]
        self._pending = (arrays, device)

    def _derive_at_upload(self, name: str) -> None:
        """Unset DeviceField `name` too, for a builder whose metadata's `after_upload` sets it from
        the uploaded fields."""
        if self._pending is None or name not in self.__dict__:
            raise RuntimeError(f"{name} can wait for an upload only while its builder's upload is pending")
        del self.__dict__[name]

    def upload_pending(self) -> None:
        """Upload the device fields a builder left unset, in one copy (`upload`), on the calling
        thread's current stream; a no-op once done. The first read of any of them does this, so
        make it (or call this) before a CUDA-graph capture or compiled code reads them: inside a
        capture it raises RuntimeError. Under FakeTensorMode the tensors are real all the same."""
        with _UPLOAD_LOCK:
            if self._pending is None:
                return
            arrays, device = self._pending
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "a builder's metadata is first read inside a CUDA-graph capture, where its upload cannot run: "
                    "capture with a State's metadata (graph_capture_get_metadata_for_batch), or read the step's "
                    "fields (md.upload_pending()) before the capture")
            if not fake_mode_active():
                tensors = upload(arrays, device)
            else:
                with unset_fake_temporarily():  # the metadata keeps real tensors, whoever reads it first
                    tensors = upload(arrays, device)
            for name, tensor in tensors.items():
                self.__dict__.setdefault(name, tensor)  # a field assigned since build() stays
            self._pending = None  # only now: a failed upload is made again at the next read
            self.after_upload()

    def after_upload(self) -> None:
        """Set the device fields a backend derives from the uploaded ones (`_derive_at_upload`);
        called once the uploaded fields are set."""

    def is_uploaded(self, name: str) -> bool:
        """Whether field `name` holds its value (no device field still waiting for the upload): no upload."""
        return name in self.__dict__ or self._pending is None or name not in _device_field_names(type(self))

    def has(self, name: str) -> bool:
        """Whether field `name` is set (not None), a device field waiting for the upload included: no upload."""
        return not self.is_uploaded(name) or self.__dict__.get(name) is not None

    @property
    def device(self) -> torch.device:
        """Where the device fields are (or go, once read): no upload."""
        return self._pending[1] if self._pending is not None else self.slot_mapping.device

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def host_arrays(self) -> dict[str, np.ndarray]:
        """The host arrays the device fields were copied from, by field name (seq_lens_tensor,
        context_lens_tensor, query_start_loc, slot_mapping, ...): the builder's; for metadata
        made otherwise (`dataclasses.replace`), the decoder fields derived once from seq_lens,
        query_lens and `block_tables_host` (the host table graph States check)."""
        if not self._host:
            seq = np.asarray(self.seq_lens, dtype=np.int64)
            starts = seq - np.asarray(self.query_lens, dtype=np.int64)
            self._host = {
                "seq_lens_tensor": seq.astype(np.int32),
                "context_lens_tensor": starts.astype(np.int32),
                "query_start_loc": prefix_sums(self.query_lens),
                "slot_mapping": slots_for(self.block_tables_host, starts, seq, self.block_size),
            }
        return self._host

    def needed_block_ids(self) -> np.ndarray:
        """The block ids the requests read, flat in request order: each one's first
        ceil(seq_len / block_size) entries of `block_tables_host`, less its rolled ones. The
        builder's checked array; for metadata made otherwise (`dataclasses.replace`), read from
        `block_tables_host` once (graph States check that table before they use these)."""
        if self._needed_block_ids is None:
            need = -(-np.asarray(self.seq_lens, dtype=np.int64) // self.block_size)
            self._needed_block_ids = live_entries(self.block_tables_host, need, self.rolled_blocks)[1]
        return self._needed_block_ids

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @property
    def longest_seq_len(self) -> int:
        """The longest sequence any request reads: decoder tokens or, for cross attention, encoder tokens."""
        return max(self.max_seq_len, self.max_encoder_seq_len)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def prefill_metadata(self) -> CommonMetadata | None:
        return self._view("prefill", 0, self.num_prefills)

    @property
    def decode_metadata(self) -> CommonMetadata | None:
        return self._view("decode", self.num_prefills, self.num_seqs)

    def _view(self, name: str, lo: int, hi: int) -> CommonMetadata | None:
        # Views are rebuilt from the host lists by the same builder (so they carry the backend's
        # own fields too) and cached: they are for inspection and tools, not the per-layer path.
        if lo == hi:
            return None
        if lo == 0 and hi == self.num_seqs:
            return self
        if name not in self._views:
            if self._builder is None:
                raise RuntimeError("this metadata was not made by a builder; it has no views")
            enc = self.encoder_seq_lens
            cross = self.cross_block_tables_list
            self._views[name] = self._builder.build_view(
                self.seq_lens[lo:hi],
                self.query_lens[lo:hi],
                self.block_tables_list[lo:hi],
                encoder_seq_lens=None if enc is None else enc[lo:hi],
                cross_block_tables=None if cross is None else cross[lo:hi],
            )
        return self._views[name]


def split_prefills(seq_lens: list[int] | np.ndarray, query_lens: list[int] | np.ndarray) -> int:
    """Validate the per-request lengths and return the number of prefills (they come first)."""
    if len(seq_lens) != len(query_lens):
        raise ValueError(f"len(seq_lens)={len(seq_lens)} != len(query_lens)={len(query_lens)}")
    s, q = np.asarray(seq_lens, dtype=np.int64), np.asarray(query_lens, dtype=np.int64)
    decode = (q == 1) & (s > 1)
    if decode.all():  # a decode step (the common one): valid lengths, nothing out of order
        return 0
    bad = (q < 1) | (s < q)
    if bad.any():
        i = int(np.argmax(bad))
        if q[i] < 1:
            raise ValueError(f"request {i}: query_len={q[i]} < 1")
        raise ValueError(f"request {i}: seq_len={s[i]} < query_len={q[i]}")
    num_prefills = int(np.argmax(decode)) if decode.any() else len(seq_lens)
    late = ~decode[num_prefills:]
    if late.any():
        i = num_prefills + int(np.argmax(late))
        raise ValueError(
            f"request {i} (seq_len={s[i]}, query_len={q[i]}) is a prefill after "
            f"decode {num_prefills}: order the batch as prefills first, then decodes"
        )
    return num_prefills


def token_positions_of(starts: np.ndarray | list[int], ends: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For the tokens at positions [starts[i], ends[i]) of each request i, concatenated: each
    token's request and its position (int64 both).

    >>> token_positions_of([6, 0], [9, 2])
    (array([0, 0, 0, 1, 1]), array([6, 7, 8, 0, 1]))
    """
    starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
    counts = ends - starts
    if counts.size and bool((counts == 1).all()):  # decodes: one position per request, nothing to repeat
        return np.arange(counts.size), starts
    request = np.repeat(np.arange(counts.size), counts)
    offset = np.arange(request.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return request, starts[request] + offset


def slots_for(tables: np.ndarray, starts: np.ndarray, ends: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slots of positions [starts[i], ends[i]) of each request i, concatenated (int64).

    tables: int [num_seqs, width], row i covering request i's first ceil(ends[i] / block_size)
    positions' blocks."""
    request, pos = token_positions_of(starts, ends)
    return tables[request, pos // block_size].astype(np.int64) * block_size + pos % block_size


def first_keys(rolled_blocks: np.ndarray | None, num_seqs: int, block_size: int) -> np.ndarray:
    """Per request, the position of the first key its gathers read: past its rolled blocks."""
    return np.zeros(num_seqs, dtype=np.int64) if rolled_blocks is None else rolled_blocks * block_size


def _host_tables(block_tables: object, checked: np.ndarray) -> list[list[int]] | np.ndarray:
    """The tables for the metadata's views, never the caller's objects (who may edit them after
    `build()`): a list of tables copied per request; for a 2-D array, the builder's own checked
    copy of its needed entries (`needed_table`; views slice it, no copy of the given width)."""
    if isinstance(block_tables, np.ndarray | torch.Tensor) and block_tables.ndim == 2:
        return checked
    # tolist() for array rows: list() of a tensor row holds 0-d views of the caller's memory
    return [t.tolist() if isinstance(t, np.ndarray | torch.Tensor) else list(t) for t in block_tables]


# Where each array of a packed byte buffer (an upload, a State's static buffers) starts: cuDNN's
# frontend (FlashInfer's cuDNN decode reads the lengths and block tables) and vectorized kernels
# assume 16-byte aligned tensors.
UPLOAD_ALIGN = 16
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def upload(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Host int32 / int64 arrays on `device`, by the same names, after one host-to-device copy
    (for CPU: the arrays themselves, no copy, but for read-only ones).

    Packed into one pinned buffer (`packed_copy`), the step's arrays take one copy, queued without
    waiting for the stream: PyTorch's caching host allocator keeps the buffer from reuse until the
    copy has run, so it may be dropped at once, and building step t+1 overlaps step t on the GPU
    (a copy from pageable memory may wait for the stream while the driver stages it). On an idle
    H200 the packing costs host time: 103-108 us a 64 x 1024 FLASHINFER decode step against 75-79
    for one pageable copy per array (`bench` suite `overhead`, BENCHMARKS.md); the loop's figures
    were all measured with this copy.
    """
    _check_upload_dtypes(arrays)
    if device.type == "cpu":  # shared, but for read-only arrays (the tables a builder froze): no tensor may view them
        return {name: torch.from_numpy(np.ascontiguousarray(a) if a.flags.writeable else a.copy())
                for name, a in arrays.items()}
    return packed_copy(arrays, lambda host: host.to(device, non_blocking=True), pin=device.type == "cuda")


def _check_upload_dtypes(arrays: dict[str, np.ndarray]) -> None:
    """TypeError unless every array has a dtype `upload` copies (int32 / int64)."""
    for name, a in arrays.items():
        if a.dtype not in _TORCH_DTYPES:
            raise TypeError(f"device field {name} must be an int32 or int64 array, got {a.dtype}")


def aligned_offsets(nbytes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Where each of the named byte sizes starts when packed in this order, each UPLOAD_ALIGN-aligned,
    and the packed total."""
    offsets, total = {}, 0
    for name, n in nbytes.items():
        offsets[name] = total
        total += -(-n // UPLOAD_ALIGN) * UPLOAD_ALIGN
    return offsets, total


def packed_copy(arrays: dict[str, np.ndarray], copy: Callable[[torch.Tensor], torch.Tensor], *,
                pin: bool = False) -> dict[str, torch.Tensor]:
    """`arrays` packed into one host byte buffer (pinned if `pin`; each array UPLOAD_ALIGN-aligned),
    `copy(buffer)` called once, and its result viewed back as the arrays, by name."""
    if not arrays:
        return {}
    offsets, total = aligned_offsets({name: a.nbytes for name, a in arrays.items()})
    host = torch.empty(max(total, UPLOAD_ALIGN), dtype=torch.uint8, pin_memory=pin)
    flat = host.numpy()
    for name, a in arrays.items():
        flat[offsets[name] : offsets[name] + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    out = copy(host)
    # one reinterpretation per dtype, then a slice (and a reshape for 2-D arrays) per array: every
    # tensor call costs host time each step, and slicing bytes first took three calls a field
    typed = {dtype: out.view(dtype) for dtype in {_TORCH_DTYPES[a.dtype] for a in arrays.values()}}
    views = {}
    for name, a in arrays.items():
        start = offsets[name] // a.itemsize
        row = typed[_TORCH_DTYPES[a.dtype]][start : start + a.size]
        views[name] = row if a.ndim == 1 else row.view(a.shape)
    return views


def prefix_sums(lens: list[int] | np.ndarray) -> np.ndarray:
    out = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=out[1:])
    return out


class HostStep(NamedTuple):
    """One step's checked host inputs, as a backend's `add_backend_fields` reads them."""

    seq_lens: list[int]
    query_lens: list[int]
    num_prefills: int
    encoder_seq_lens: list[int] | None
    block_table: np.ndarray  # the checked host table [num_seqs, width]
    block_ids: np.ndarray  # the ids its requests read, flat in request order (`needed_block_ids`)
    cross_block_table: np.ndarray | None  # the checked table of the encoder's blocks, or None
    rolled_blocks: np.ndarray | None  # per request, the leading blocks a rolling table freed (None: no rolling)


class CommonMetadataBuilder(AttentionMetadataBuilder):
    """Validates a step and builds `CommonMetadata`; backends set `backend_cls` and override
    `metadata_cls` and `add_backend_fields` (host work for their own inputs)."""

    metadata_cls: type[CommonMetadata] = CommonMetadata
    backend_cls: ClassVar[type[AttentionBackend] | None] = None  # whose metadata this builds

    @property
    def backend_name(self) -> str:
        """What the metadata records as its builder's backend ("" without one)."""
        return "" if self.backend_cls is None else self.backend_cls.get_name()

    def __init__(self, spec: AttentionSpec, *, rolling_tables: bool = False) -> None:
        """`rolling_tables`: (sliding-window DECODER specs) the caller frees the blocks a request's
        window has left behind, so each table's entries before the window of the request's first
        new token are ignored (see `CommonMetadata.rolled_blocks`)."""
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"a builder is made from an AttentionSpec, got {type(spec).__name__}")
        if rolling_tables and (spec.sliding_window is None or spec.attn_type != AttentionType.DECODER):
            raise ValueError("rolling_tables=True needs a DECODER spec with a sliding_window: other layers read "
                             "every block of a request")
        super().__init__(spec)
        self.rolling_tables = bool(rolling_tables)
        self.device = spec.device
        self._block_scratch: np.ndarray | None = None  # cross tables' (`check_block_ids`)
        self._block_ids = BlockIdCheck(spec.num_blocks)  # block_tables', step after step
        check_device_available(self.device)
        self._check_backend_serves(spec)

    def build_view(self, *args: Any, **kwargs: Any) -> CommonMetadata:
        """`build()` for a view of a built step (`prefill_metadata`, `decode_metadata`): a backend
        whose build() does per-step work that a view, made for inspection, must not repeat
        (FlashInfer's plan) overrides it."""
        return self.build(*args, **kwargs)

    def _check_backend_serves(self, spec: AttentionSpec) -> None:
        """NotImplementedError for spec options this builder's backend lacks (and would otherwise
        ignore: a soft-cap on XFORMERS, fp8 on TORCH_SDPA, ...). A CPU spec of a CUDA backend is
        not refused, nor its dtype: the CPU tests run those backends' host logic with stand-in
        kernels (any dtype); on CUDA the dtype is checked."""
        if self.backend_cls is None:
            return
        needs = spec_needs(spec)
        del needs["device"]
        if spec.device.type != "cuda":
            del needs["dtype"]
        reason = capability_reason(self.backend_cls, **needs)
        if reason is not None:
            raise NotImplementedError(f"{reason}: its builder cannot serve this spec; {alternatives(**needs)}")

    def build(
        self,
        seq_lens: list[int] | np.ndarray,
        query_lens: list[int] | np.ndarray,
        block_tables: list[list[int]] | np.ndarray,
        encoder_seq_lens: list[int] | None = None,
        cross_block_tables: list[list[int]] | np.ndarray | None = None,
    ) -> CommonMetadata:
        """Validate one step and build its metadata. Lengths: lists or 1-D int arrays; tables: a
        list of per-request lists, or one 2-D int array [num_seqs, >= blocks needed] (entries past
        a request's need are ignored): the array form does no per-element Python work."""
        spec = self.spec
        seq_a, query_a = int_array(seq_lens, "seq_lens"), int_array(query_lens, "query_lens")
        if not seq_a.size:  # in any form: nothing would run such a step (the runner refuses it too)
            raise ValueError("a step needs at least one request: seq_lens is empty")
        seq_lens, query_lens = seq_a.tolist(), query_a.tolist()
        num_prefills = split_prefills(seq_a, query_a)
        check_total(query_lens, "query_lens")
        starts = seq_a - query_a
        uses_cache = spec.attn_type not in CACHELESS_TYPES
        num_prefill_tokens = int(query_a[:num_prefills].sum())
        num_tokens = int(query_a.sum())
        # a sliding-window layer group's server may free the blocks its window left behind
        rolled = rolled_blocks(starts, spec.sliding_window, spec.block_size) if self.rolling_tables else None
        if uses_cache:
            table, ids, row_ends, need = needed_table(block_tables, seq_a, spec.block_size, "block_tables", rolled)
            shared = self._block_ids(table, need, ids, row_ends, "block_tables", rolled)
            slot_mapping = slots_for(table, starts, seq_a, spec.block_size)
            if shared:
                check_written_blocks(slot_mapping, query_lens, ids, row_ends, spec.block_size, "block_tables")
        else:
            bad = np.nonzero(seq_a != query_a)[0]
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"request {i}: {spec.attn_type.name} attention has no cache, so "
                    f"seq_len ({seq_lens[i]}) must equal query_len ({query_lens[i]})"
                )
            table, ids = np.zeros((len(seq_lens), 1), dtype=np.int32), np.zeros(0, dtype=np.int64)
            slot_mapping = np.full(num_tokens, -1, dtype=np.int64)
        int32_parts = {
            "seq_lens_tensor": seq_a.astype(np.int32),
            "context_lens_tensor": starts.astype(np.int32),
            "query_start_loc": prefix_sums(query_a),
        }
        int64_parts = {"slot_mapping": slot_mapping}
        tables = {"block_tables": table}  # ids checked: int32 holds them
        cross: dict[str, Any] = {}
        if cross_block_tables is not None and encoder_seq_lens is None:
            raise ValueError("cross_block_tables without encoder_seq_lens: pass each request's encoder length too "
                             "(the cross tables cover that many tokens)")
        if encoder_seq_lens is not None:
            cross = self._cross_fields(
                encoder_seq_lens, cross_block_tables, num_prefills, int32_parts, int64_parts, tables
            )
        elif spec.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_DECODER):
            raise ValueError(
                f"{spec.attn_type.name} attention needs encoder_seq_lens (and, for cross "
                "attention, cross_block_tables) in build()"
            )
        step = HostStep(seq_lens, query_lens, num_prefills, cross.get("encoder_seq_lens"), table, ids,
                        tables.get("cross_block_tables"), rolled)
        backend_fields = self.add_backend_fields(step)
        uploads = {name: a for name, a in backend_fields.items() if isinstance(a, np.ndarray)}
        if not uploads.keys() <= _device_field_names(self.metadata_cls):
            raise TypeError(f"{self.metadata_cls.__name__} must declare its uploaded fields "
                            f"{sorted(uploads.keys() - _device_field_names(self.metadata_cls))} as DeviceField(None)")
        _check_upload_dtypes(uploads)  # here, not at the deferred upload: build() refuses the step
        arrays = self._device_arrays(int32_parts, int64_parts, tables, uploads)
        fields = {**backend_fields, **dict.fromkeys(arrays)}  # unset below (`_defer_upload`)
        for checked in tables.values():  # graph refills trust these host tables while nobody can edit them
            checked.flags.writeable = False
        md = self.metadata_cls(
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_tokens - num_prefill_tokens,
            seq_lens=seq_lens,
            query_lens=query_lens,
            block_tables_list=_host_tables(block_tables, table) if uses_cache else [[] for _ in seq_lens],
            max_query_len=int(query_a.max(initial=0)),
            max_seq_len=int(seq_a.max(initial=0)),
            backend_name=self.backend_name,
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            spec=spec,
            block_tables_host=tables["block_tables"],
            cross_block_tables_host=tables.get("cross_block_tables"),
            block_tables_checked=need if uses_cache else None,
            cross_block_tables_checked=(None if "cross_block_tables" not in tables else
                                        -(-np.asarray(encoder_seq_lens, dtype=np.int64) // spec.block_size)),
            rolled_blocks=rolled,
            **cross,
            **fields,
        )
        md._builder = self
        md._needed_block_ids = ids
        md._host = {**int32_parts, **int64_parts}
        md._defer_upload(arrays, indexed_device(self.device))
        return md

    def _scratch(self) -> np.ndarray:
        """The all-False bool [num_blocks] bitmap `check_block_ids` marks, allocated (and paged in) once."""
        if self._block_scratch is None:
            self._block_scratch = np.zeros(self.spec.num_blocks, dtype=bool)
        return self._block_scratch

    def _cross_fields(
        self,
        encoder_seq_lens: list[int],
        cross_block_tables: list[list[int]] | None,
        num_prefills: int,
        int32_parts: dict[str, np.ndarray],
        int64_parts: dict[str, np.ndarray],
        tables: dict[str, np.ndarray],
    ) -> dict[str, Any]:
        spec = self.spec
        encoder_seq_lens = int_list(encoder_seq_lens, "encoder_seq_lens")
        if len(encoder_seq_lens) != len(int32_parts["seq_lens_tensor"]):
            raise ValueError(
                f"len(encoder_seq_lens)={len(encoder_seq_lens)} != number of requests "
                f"{len(int32_parts['seq_lens_tensor'])}"
            )
        if any(n < 1 for n in encoder_seq_lens):
            raise ValueError(f"encoder_seq_lens must all be >= 1, got {encoder_seq_lens}")
        check_total(encoder_seq_lens, "encoder_seq_lens")
        int32_parts["encoder_seq_lens_tensor"] = np.asarray(encoder_seq_lens, dtype=np.int32)
        int32_parts["encoder_seq_start_loc"] = prefix_sums(encoder_seq_lens)
        if cross_block_tables is not None:
            enc = np.asarray(encoder_seq_lens, dtype=np.int64)
            table, ids, row_ends, _ = needed_table(cross_block_tables, enc, spec.block_size, "cross_block_tables")
            shared = check_block_ids(ids, row_ends, spec.num_blocks, "cross_block_tables", self._scratch())
            pre = encoder_seq_lens[:num_prefills]
            int64_parts["cross_slot_mapping"] = slots = slots_for(table[:num_prefills], np.zeros(len(pre)), pre,
                                                                  spec.block_size)
            if shared:
                check_written_blocks(slots, pre, ids, row_ends, spec.block_size, "cross_block_tables")
            tables["cross_block_tables"] = table
        elif spec.attn_type == AttentionType.ENCODER_DECODER:
            raise ValueError("ENCODER_DECODER attention needs cross_block_tables in build()")
        return {
            "encoder_seq_lens": encoder_seq_lens,
            "cross_block_tables_list": None if cross_block_tables is None
            else _host_tables(cross_block_tables, tables["cross_block_tables"]),
            "max_encoder_seq_len": max(encoder_seq_lens, default=0),
            "num_encoder_tokens": sum(encoder_seq_lens),
        }

    @staticmethod
    def _device_arrays(
        int32_parts: dict[str, np.ndarray],
        int64_parts: dict[str, np.ndarray],
        tables: dict[str, np.ndarray],
        backend_parts: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """The step's device fields as the host arrays one `upload` copies, by field name; tables
        and backend_parts as they are (int32 / int64)."""
        arrays = {name: a.astype(np.int32, copy=False) for name, a in int32_parts.items()}
        arrays.update((name, a.astype(np.int64, copy=False)) for name, a in int64_parts.items())
        return {**arrays, **tables, **(backend_parts or {})}

    def _to_device(
        self,
        int32_parts: dict[str, np.ndarray],
        int64_parts: dict[str, np.ndarray],
        tables: dict[str, np.ndarray],
    ) -> dict[str, torch.Tensor]:
        """Fields uploaded at once, in one copy (`upload`): a backend's own, after the common ones."""
        return upload(self._device_arrays(int32_parts, int64_parts, tables), self.device)

    def add_backend_fields(self, step: HostStep) -> dict[str, Any]:
        """Host work for the backend's own metadata fields, by name. A numpy array (int32 / int64)
        is a device field, declared `DeviceField(None)` on `metadata_cls`: it reaches the device in
        the step's one copy with the common fields."""
        return {}


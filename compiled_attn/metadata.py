"""Builder logic every backend shares: validation, slot mapping, block tables, query_start_loc.

All of it runs on the host over python lists and numpy, then moves to the device in a handful
of copies. Backends subclass `CommonMetadata` / `CommonMetadataBuilder` to add their own inputs
(FlashInfer's indptr, SDPA's padded gather indices, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
import torch

from compiled_attn.abstract import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    AttentionType,
)
from compiled_attn.capabilities import capability_reason, spec_needs
from compiled_attn.validation import (
    CACHELESS_TYPES,
    check_block_ids,
    check_device_available,
    check_total,
    check_written_blocks,
    int_list,
    needed_ids,
    table_rows,
)


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
    Host copies the device tables were made from (what graph States check before a replay):
        block_tables_host / cross_block_tables_host: int32 numpy, the tables above
    """

    seq_lens: list[int]
    query_lens: list[int]
    block_tables_list: list[list[int]]
    max_query_len: int
    max_seq_len: int
    seq_lens_tensor: torch.Tensor
    context_lens_tensor: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    encoder_seq_lens: list[int] | None = None
    cross_block_tables_list: list[list[int]] | None = None
    max_encoder_seq_len: int = 0
    num_encoder_tokens: int = 0
    encoder_seq_lens_tensor: torch.Tensor | None = None
    encoder_seq_start_loc: torch.Tensor | None = None
    cross_block_tables: torch.Tensor | None = None
    cross_slot_mapping: torch.Tensor | None = None
    backend_name: str = ""
    block_size: int = 0
    num_blocks: int = 0
    spec: AttentionSpec | None = None
    block_tables_host: np.ndarray | None = None
    cross_block_tables_host: np.ndarray | None = None

    def __post_init__(self) -> None:
        self._views: dict[str, AttentionMetadata | None] = {}
        self._builder: CommonMetadataBuilder | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

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
            self._views[name] = self._builder.build(
                self.seq_lens[lo:hi],
                self.query_lens[lo:hi],
                self.block_tables_list[lo:hi],
                encoder_seq_lens=None if enc is None else enc[lo:hi],
                cross_block_tables=None if cross is None else cross[lo:hi],
            )
        return self._views[name]


def split_prefills(seq_lens: list[int], query_lens: list[int]) -> int:
    """Validate the per-request lengths and return the number of prefills (they come first)."""
    if len(seq_lens) != len(query_lens):
        raise ValueError(f"len(seq_lens)={len(seq_lens)} != len(query_lens)={len(query_lens)}")
    num_prefills = None
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        if query_len < 1:
            raise ValueError(f"request {i}: query_len={query_len} < 1")
        if seq_len < query_len:
            raise ValueError(f"request {i}: seq_len={seq_len} < query_len={query_len}")
        is_decode = query_len == 1 and seq_len > 1
        if is_decode and num_prefills is None:
            num_prefills = i
        elif not is_decode and num_prefills is not None:
            raise ValueError(
                f"request {i} (seq_len={seq_len}, query_len={query_len}) is a prefill after "
                f"decode {num_prefills}: order the batch as prefills first, then decodes"
            )
    return len(seq_lens) if num_prefills is None else num_prefills


def slots_for(
    block_tables: list[list[int]] | list[np.ndarray], starts: list[int], ends: list[int], block_size: int
) -> np.ndarray:
    """Cache slots of positions [start, end) of each request, concatenated (int64)."""
    parts = []
    for table, start, end in zip(block_tables, starts, ends, strict=True):
        pos = np.arange(start, end, dtype=np.int64)
        blocks = np.asarray(table[: -(-end // block_size)], dtype=np.int64)[pos // block_size]
        parts.append(blocks * block_size + pos % block_size)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array copied to `device` without waiting for the stream. From pageable memory the
    driver stages the bytes before the call returns (the array may be dropped at once); a blocking
    copy would also wait for all queued GPU work, so building step t+1 could not overlap step t."""
    return torch.from_numpy(a).to(device, non_blocking=True)


def padded_table(rows: list[np.ndarray], width: int) -> np.ndarray:
    """Each request's needed blocks (`table_rows`, ids checked) as one int32 [num_seqs, width]
    array, padded with block 0 (always valid)."""
    out = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def prefix_sums(lens: list[int]) -> np.ndarray:
    out = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=out[1:])
    return out


class CommonMetadataBuilder(AttentionMetadataBuilder):
    """Validates a step and builds `CommonMetadata`; backends set `backend_cls` and override
    `metadata_cls` and `add_backend_fields` (host work for their own inputs)."""

    metadata_cls: type[CommonMetadata] = CommonMetadata
    backend_cls: ClassVar[type[AttentionBackend] | None] = None  # whose metadata this builds

    @property
    def backend_name(self) -> str:
        """What the metadata records as its builder's backend ("" without one)."""
        return "" if self.backend_cls is None else self.backend_cls.get_name()

    def __init__(self, spec: AttentionSpec) -> None:
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"a builder is made from an AttentionSpec, got {type(spec).__name__}")
        super().__init__(spec)
        self.device = spec.device
        check_device_available(self.device)
        self._check_backend_serves(spec)

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
            raise NotImplementedError(f"{reason}: its builder cannot serve this spec")

    def build(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        encoder_seq_lens: list[int] | None = None,
        cross_block_tables: list[list[int]] | None = None,
    ) -> CommonMetadata:
        spec = self.spec
        seq_lens, query_lens = int_list(seq_lens, "seq_lens"), int_list(query_lens, "query_lens")
        num_prefills = split_prefills(seq_lens, query_lens)
        check_total(query_lens, "query_lens")
        uses_cache = spec.attn_type not in CACHELESS_TYPES
        if not uses_cache:
            for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
                if s != q:
                    raise ValueError(
                        f"request {i}: {spec.attn_type.name} attention has no cache, so "
                        f"seq_len ({s}) must equal query_len ({q})"
                    )
            rows = [np.zeros(0, dtype=np.int64) for _ in seq_lens]  # block tables are ignored
        else:
            rows = table_rows(block_tables, seq_lens, spec.block_size, "block_tables")
        starts = [s - q for s, q in zip(seq_lens, query_lens, strict=True)]
        num_prefill_tokens = sum(query_lens[:num_prefills])
        num_tokens = sum(query_lens)
        width = max([len(r) for r in rows] + [1])
        if uses_cache:
            ids, request = needed_ids(rows)
            check_block_ids(ids, request, spec.num_blocks, "block_tables")
            slot_mapping = slots_for(rows, starts, seq_lens, spec.block_size)
            check_written_blocks(slot_mapping, query_lens, ids, request, spec.block_size, "block_tables")
        else:
            slot_mapping = np.full(num_tokens, -1, dtype=np.int64)
        int32_parts = {
            "seq_lens_tensor": np.asarray(seq_lens, dtype=np.int32),
            "context_lens_tensor": np.asarray(starts, dtype=np.int32),
            "query_start_loc": prefix_sums(query_lens),
        }
        int64_parts = {"slot_mapping": slot_mapping}
        tables = {"block_tables": padded_table(rows, width)}  # ids checked: int32 holds them
        cross: dict[str, Any] = {}
        if encoder_seq_lens is not None:
            cross = self._cross_fields(
                encoder_seq_lens, cross_block_tables, num_prefills, int32_parts, int64_parts, tables
            )
        elif spec.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_DECODER):
            raise ValueError(
                f"{spec.attn_type.name} attention needs encoder_seq_lens (and, for cross "
                "attention, cross_block_tables) in build()"
            )
        tensors = self._to_device(int32_parts, int64_parts, tables)
        md = self.metadata_cls(
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_tokens - num_prefill_tokens,
            seq_lens=seq_lens,
            query_lens=query_lens,
            block_tables_list=[list(t) for t in block_tables] if uses_cache else [[] for _ in seq_lens],
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            backend_name=self.backend_name,
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            spec=spec,
            block_tables_host=tables["block_tables"],
            cross_block_tables_host=tables.get("cross_block_tables"),
            **cross,
            **tensors,
            **self.add_backend_fields(seq_lens, query_lens, num_prefills, cross.get("encoder_seq_lens")),
        )
        md._builder = self
        return md

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
            rows = table_rows(cross_block_tables, encoder_seq_lens, spec.block_size, "cross_block_tables")
            ids, request = needed_ids(rows)
            check_block_ids(ids, request, spec.num_blocks, "cross_block_tables")
            pre = encoder_seq_lens[:num_prefills]
            int64_parts["cross_slot_mapping"] = slots = slots_for(rows[:num_prefills], [0] * len(pre), pre,
                                                                  spec.block_size)
            check_written_blocks(slots, pre, ids, request, spec.block_size, "cross_block_tables")
            tables["cross_block_tables"] = padded_table(rows, max([len(r) for r in rows] + [1]))
        elif spec.attn_type == AttentionType.ENCODER_DECODER:
            raise ValueError("ENCODER_DECODER attention needs cross_block_tables in build()")
        return {
            "encoder_seq_lens": encoder_seq_lens,
            "cross_block_tables_list": None if cross_block_tables is None
            else [list(t) for t in cross_block_tables],
            "max_encoder_seq_len": max(encoder_seq_lens, default=0),
            "num_encoder_tokens": sum(encoder_seq_lens),
        }

    def _to_device(
        self,
        int32_parts: dict[str, np.ndarray],
        int64_parts: dict[str, np.ndarray],
        tables: dict[str, np.ndarray],
    ) -> dict[str, torch.Tensor]:
        # One host->device copy per dtype for the common fields instead of one per field (~10 us each).
        out: dict[str, torch.Tensor] = {}
        for parts, dtype in ((int32_parts, np.int32), (int64_parts, np.int64)):
            flat = np.concatenate([a.reshape(-1) for a in parts.values()]).astype(dtype, copy=False)
            dev = to_device(flat, self.device)
            offset = 0
            for name, a in parts.items():
                out[name] = dev[offset : offset + a.size]
                offset += a.size
        for name, table in tables.items():
            out[name] = to_device(table, self.device)
        return out

    def add_backend_fields(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        num_prefills: int,
        encoder_seq_lens: list[int] | None,
    ) -> dict[str, Any]:
        """Host work for the backend's own metadata fields."""
        return {}


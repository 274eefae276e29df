"""The common builder (slot mapping, block tables, lengths, prefill/decode split, cross fields) and
TORCH_SDPA's padded layout, checked against values worked out by hand."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

import compiled_attn as ca
from compiled_attn import block_ids
from compiled_attn.backends import flashinfer as fib
from compiled_attn.bench.kernel_table import cuda_kernels
from compiled_attn.block_ids import BlockIdCheck
from compiled_attn.metadata import UPLOAD_ALIGN, DeviceField, packed_copy, upload
from compiled_attn.validation import check_block_ids, indexed_device, needed_table, rolled_blocks

T = ca.AttentionType
BACKEND = ca.get_attn_backend("TORCH_SDPA")
BS, NB = 4, 32


def builder(attn_type: T = T.DECODER):
    spec = ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, block_size=BS, num_blocks=NB,
                            dtype=torch.float32, device="cpu", attn_type=attn_type)
    return BACKEND.get_builder_cls()(spec)


@pytest.fixture
def mixed():
    # a prefill with a cached prefix (6 of 9 cached), a full prefill, two decodes
    return builder().build([9, 5, 7, 4], [3, 5, 1, 1], [[10, 3, 8], [0, 21], [5, 6], [31]])


def test_slot_mapping(mixed):
    # request 0: positions 6..8 -> block 3 slots 2, 3; block 8 slot 0; request 1: 0..4 -> blocks 0, 21;
    # request 2: position 6 -> block 6 slot 2; request 3: position 3 -> block 31 slot 3
    assert mixed.slot_mapping.tolist() == [14, 15, 32, 0, 1, 2, 3, 84, 26, 127]
    assert mixed.slot_mapping.dtype == torch.int64


def test_block_tables_padded_with_block_zero(mixed):
    assert mixed.block_tables.dtype == torch.int32
    assert mixed.block_tables.tolist() == [[10, 3, 8], [0, 21, 0], [5, 6, 0], [31, 0, 0]]


def test_block_tables_width_is_blocks_needed_not_table_length():
    md = builder().build([5, 2], [5, 2], [[1, 2, 3, 4], [7, 9, 11]])
    # request 1 needs one block: its entries past that (9, 11) are ignored, never copied (pad 0)
    assert md.block_tables.tolist() == [[1, 2], [7, 0]]
    assert md.block_tables_list == [[1, 2, 3, 4], [7, 9, 11]]


def test_lengths(mixed):
    assert mixed.seq_lens_tensor.tolist() == [9, 5, 7, 4]
    assert mixed.context_lens_tensor.tolist() == [6, 0, 6, 3]
    assert mixed.query_start_loc.tolist() == [0, 3, 8, 9, 10]
    for t in (mixed.seq_lens_tensor, mixed.context_lens_tensor, mixed.query_start_loc):
        assert t.dtype == torch.int32
    assert (mixed.max_query_len, mixed.max_seq_len) == (5, 9)


def test_prefill_decode_split(mixed):
    assert (mixed.num_prefills, mixed.num_decodes) == (2, 2)
    assert (mixed.num_prefill_tokens, mixed.num_decode_tokens, mixed.num_tokens) == (8, 2, 10)


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "num_prefills"),
    [([1], [1], 1), ([1, 1], [1, 1], 2), ([3, 1, 6], [3, 1, 1], 2), ([6, 2], [1, 1], 0), ([4, 9], [4, 2], 2)],
    ids=["one_token_prompt", "two_one_token_prompts", "one_token_prompt_then_decode", "decodes", "chunks"],
)
def test_one_token_prompt_is_a_prefill(seq_lens, query_lens, num_prefills):
    tables = [[2 * i, 2 * i + 1, 20 + i] for i in range(len(seq_lens))]
    md = builder().build(seq_lens, query_lens, tables)
    assert md.num_prefills == num_prefills
    assert md.num_prefill_tokens == sum(query_lens[:num_prefills])


def test_prefill_view(mixed):
    pre = mixed.prefill_metadata
    assert isinstance(pre, BACKEND.get_metadata_cls())
    assert (pre.num_prefills, pre.num_prefill_tokens, pre.num_decode_tokens) == (2, 8, 0)
    assert pre.seq_lens == [9, 5] and pre.query_lens == [3, 5]
    assert torch.equal(pre.slot_mapping, mixed.slot_mapping[:8])
    assert pre.block_tables.tolist() == [[10, 3, 8], [0, 21, 0]]
    assert pre.decode_metadata is None
    assert pre.prefill_metadata is pre


def test_decode_view(mixed):
    dec = mixed.decode_metadata
    assert isinstance(dec, BACKEND.get_metadata_cls())
    assert (dec.num_prefills, dec.num_prefill_tokens, dec.num_decode_tokens) == (0, 0, 2)
    assert torch.equal(dec.slot_mapping, mixed.slot_mapping[8:])
    assert dec.seq_lens_tensor.tolist() == [7, 4]
    assert dec.block_tables.tolist() == [[5, 6], [31, 0]]
    assert dec.prefill_metadata is None
    assert dec.decode_metadata is dec
    assert mixed.decode_metadata is dec  # cached


@pytest.mark.parametrize("as_array", [np.array, torch.tensor, lambda rows: [torch.tensor(r) for r in rows]],
                         ids=["numpy", "tensor", "tensor rows"])
def test_views_ignore_edits_to_an_array_table_after_build(as_array):
    """The views are built when first read, from the builder's own copy of the tables: a server
    that reuses its table array (or its rows' tensors) for the next step must not change this
    step's views."""
    tables = as_array([[10, 3, 8, 99], [0, 21, 98, 97], [5, 6, 96, 95], [31, 94, 93, 92]])
    cross = as_array([[11, 12], [13, 14], [15, 16], [17, 18]])
    md = builder(T.ENCODER_DECODER).build([9, 5, 7, 4], [3, 5, 1, 1], tables, encoder_seq_lens=[5, 3, 2, 8],
                                          cross_block_tables=cross)
    for table, value in ((tables, 1), (cross, 2)):
        for part in table if isinstance(table, list) else [table]:
            part[...] = value
    pre, dec = md.prefill_metadata, md.decode_metadata
    assert pre.block_tables.tolist() == [[10, 3, 8], [0, 21, 0]]
    assert dec.block_tables.tolist() == [[5, 6], [31, 0]]
    assert pre.cross_block_tables.tolist() == [[11, 12], [13, 0]]
    assert dec.cross_block_tables.tolist() == [[15, 0], [17, 18]]


def test_views_of_metadata_not_made_by_a_builder_raise(mixed):
    replaced = dataclasses.replace(mixed)  # the same fields, made by `replace`: no builder to rebuild views with
    for view in ("prefill_metadata", "decode_metadata"):
        with pytest.raises(RuntimeError, match="^this metadata was not made by a builder; it has no views$"):
            getattr(replaced, view)
    assert replaced.seq_lens == mixed.seq_lens


def test_a_builder_is_made_from_a_spec(contract_backend):
    spec = builder().spec
    for not_a_spec in (dataclasses.asdict(spec), None):
        match = f"^a builder is made from an AttentionSpec, got {type(not_a_spec).__name__}$"
        with pytest.raises(ValueError, match=match):
            contract_backend.get_builder_cls()(not_a_spec)


def test_asdict_zerocopy_shares_tensors(mixed):
    d = mixed.asdict_zerocopy(skip_fields={"block_tables"})
    assert "block_tables" not in d
    assert d["slot_mapping"] is mixed.slot_mapping
    assert d["num_prefills"] == 2


def test_metadata_knows_its_backend_and_spec(mixed):
    assert mixed.backend_name == "TORCH_SDPA"
    assert (mixed.block_size, mixed.num_blocks) == (BS, NB)
    assert mixed.slot_mapping.device.type == "cpu"


def test_cross_fields():
    md = builder(T.ENCODER_DECODER).build(
        [3, 6, 2], [3, 1, 1], [[0], [1, 2], [3]],
        encoder_seq_lens=[6, 2, 9], cross_block_tables=[[10, 11], [12], [13, 14, 15]],
    )
    assert md.encoder_seq_lens == [6, 2, 9]
    assert md.encoder_seq_lens_tensor.tolist() == [6, 2, 9]
    assert md.encoder_seq_start_loc.tolist() == [0, 6, 8, 17]
    assert (md.num_encoder_tokens, md.max_encoder_seq_len) == (17, 9)
    assert md.cross_block_tables.tolist() == [[10, 11, 0], [12, 0, 0], [13, 14, 15]]
    # only the prefill's encoder tokens are written this step; the decodes' are cached already
    assert md.cross_slot_mapping.tolist() == [40, 41, 42, 43, 44, 45]
    assert md.cross_slot_mapping.dtype == torch.int64
    dec = md.decode_metadata
    assert dec.cross_block_tables.tolist() == [[12, 0, 0], [13, 14, 15]]
    assert dec.cross_slot_mapping.numel() == 0


def test_no_cross_fields_for_decoder(mixed):
    assert mixed.encoder_seq_lens is None and mixed.cross_block_tables is None
    assert mixed.cross_slot_mapping is None and mixed.num_encoder_tokens == 0


def test_encoder_only_has_pad_slots_and_no_tables():
    md = builder(T.ENCODER_ONLY).build([3, 2], [3, 2], [])
    assert md.slot_mapping.tolist() == [-1] * 5
    assert md.num_prefills == 2
    assert md.block_tables.shape == (2, 1)


def test_sdpa_prefill_padded_layout():
    # prefills with query lens 3, 1, 2 starting at sequence positions 2, 0, 0; then one decode
    md = builder().build([5, 1, 2, 6], [3, 1, 2, 1], [[0, 1], [2], [3], [4, 5]])
    assert md.prefill_token_index.tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 4]]  # pads repeat row 0
    assert md.prefill_q_pos.tolist() == [[2, 3, 4], [0, 0, 0], [0, 1, 0]]
    assert md.prefill_flat_index.tolist() == [0, 1, 2, 3, 6, 7]
    for name in ("prefill_token_index", "prefill_q_pos", "prefill_flat_index"):
        assert getattr(md, name).dtype == torch.int64


def test_sdpa_decode_only_has_no_prefill_layout():
    md = builder().build([6, 3], [1, 1], [[4, 5], [1]])
    assert md.prefill_token_index is None and md.prefill_flat_index is None


def test_sdpa_encoder_padded_layout():
    md = builder(T.ENCODER).build([2, 1], [2, 1], [], encoder_seq_lens=[1, 3])
    assert md.encoder_token_index.tolist() == [[0, 0, 0], [1, 2, 3]]
    assert md.encoder_q_pos.tolist() == [[0, 0, 0], [0, 1, 2]]
    assert md.encoder_flat_index.tolist() == [0, 3, 4, 5]


# -------------------------------------------------------------------------------------------
# Block tables as one array (what a server keeps): the same metadata as lists, no per-element work


def _same_metadata(a, b) -> None:
    for name in ("num_prefills", "num_prefill_tokens", "num_decode_tokens", "seq_lens", "query_lens",
                 "max_seq_len", "max_query_len"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("slot_mapping", "seq_lens_tensor", "context_lens_tensor", "query_start_loc", "block_tables"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("attn_type", [ca.AttentionType.DECODER, ca.AttentionType.ENCODER_ONLY])
@pytest.mark.parametrize(("backend_name", "block_size"), [("TORCH_SDPA", BS), ("FLASHINFER", BS), ("XFORMERS", 64)])
@pytest.mark.parametrize("form", ["lists", "arrays"])
def test_an_empty_step_is_refused_in_every_form(backend_name, block_size, attn_type, form):
    """A step of no requests is a ValueError from every builder, whatever the tables' form (lists
    crashed with an IndexError, arrays built an empty metadata)."""
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=block_size, num_blocks=NB,
                            dtype=torch.bfloat16, device="cpu", attn_type=attn_type)
    builder = ca.registry.BACKEND_CLASSES()[backend_name].get_builder_cls()(spec)
    lens = np.zeros(0, np.int64)
    empty = ([], [], []) if form == "lists" else (lens, lens, np.zeros((0, 2), np.int32))
    with pytest.raises(ValueError, match=r"^a step needs at least one request: seq_lens is empty$"):
        builder.build(*empty)


@pytest.mark.parametrize("backend_name", ["TORCH_SDPA", "FLASHINFER"])
def test_array_tables_build_what_lists_build(backend_name):
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=BS, num_blocks=NB,
                            dtype=torch.bfloat16, device="cpu")
    b = ca.registry.BACKEND_CLASSES()[backend_name].get_builder_cls()(spec)  # host logic: no FlashInfer needed
    rng = np.random.default_rng(7)
    for trial in range(20):
        n = int(rng.integers(1, 6))
        seq = rng.integers(1, 6 * BS, n)
        query = np.where(np.arange(n) < n // 2, np.minimum(seq, rng.integers(1, 9, n)), 1)  # prefills, then decodes
        seq = np.where(query == 1, np.maximum(seq, 2), seq)
        need = -(-seq // BS)
        table = rng.permutation(NB)[: n * 6].reshape(n, 6).astype(np.int32)
        table[np.arange(6)[None, :] >= need[:, None]] = -77  # junk past each request's need: ignored
        want = b.build(seq.tolist(), query.tolist(), [row[:k].tolist() for row, k in zip(table, need, strict=True)])
        # unsigned too: the junk wraps past int64 there (-77 -> 2**64 - 77), and is ignored all the same
        for tables in (table, torch.from_numpy(table).long(), table.astype(np.int64), table.astype(np.uint64),
                       torch.from_numpy(table.astype(np.uint64))):
            got = b.build(seq, query, tables)
            _same_metadata(got, want)
            if backend_name == "FLASHINFER":
                assert torch.equal(got.paged_kv_indices, want.paged_kv_indices), trial
                assert torch.equal(got.paged_kv_indptr, want.paged_kv_indptr)


@pytest.mark.parametrize(
    ("tables", "match"),
    [
        (lambda t: t.astype(np.float32), "integer block ids"),
        (lambda t: t[:, :1], r"block_tables\[0\] has 1 blocks but needs 3"),
        (lambda t: t[:1], "number of requests"),
        (lambda t: np.where(t == t[1, 0], NB, t), f"names block {NB}, outside"),
        (lambda t: np.where(t == t[1, 1], t[1, 0], t), "names block .* twice"),
        (lambda t: np.where(t == t[1, 2], t[0, 2], t), "written this step by request"),
        (lambda t: torch.from_numpy(t).float(), "integer block ids"),
    ],
    ids=["float", "too_narrow", "rows", "range", "duplicate", "shared_written_block", "float_tensor"],
)
def test_bad_array_tables_raise_before_anything_is_built(tables, match):
    seq, query = np.array([9, 10]), np.array([1, 1])  # two decodes needing 3 blocks each
    table = np.array([[3, 4, 5, 17], [6, 7, 8, 19]], dtype=np.int32)
    with pytest.raises(ValueError, match=match):
        builder().build(seq, query, tables(table))


@pytest.mark.parametrize("backend_name", ["TORCH_SDPA", "FLASHINFER", "XFORMERS"])
def test_decode_step_of_full_tables_builds_what_lists_build(backend_name):
    # every entry of every row is read: the builder's no-mask paths (one slot per decode, the
    # table copied whole, FlashInfer's page list read off the device table)
    bs = 64 if backend_name == "XFORMERS" else BS
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=bs, num_blocks=NB,
                            dtype=torch.bfloat16, device="cpu")
    b = ca.registry.BACKEND_CLASSES()[backend_name].get_builder_cls()(spec)
    seq = np.array([3 * bs, 2 * bs + 1, 3 * bs - 1])  # three blocks each
    table = np.random.default_rng(3).permutation(NB)[:9].reshape(3, 3).astype(np.int32)
    want = b.build(seq.tolist(), [1, 1, 1], table.tolist())
    last = seq - 1  # each decode writes its last position
    assert want.slot_mapping.tolist() == (table[np.arange(3), last // bs] * bs + last % bs).tolist()
    as_tensors = (torch.from_numpy(seq), torch.ones(3, dtype=torch.int64), torch.from_numpy(table).long())
    for lens, query, tables in ((seq, np.ones(3, int), table), as_tensors):
        got = b.build(lens, query, tables)
        _same_metadata(got, want)
        if backend_name == "FLASHINFER":
            assert got.paged_kv_indices.tolist() == table.reshape(-1).tolist()
    got = b.build(seq, np.ones(3, int), table)
    table[:] = 0  # the metadata holds copies: the caller may reuse its table at once
    _same_metadata(got, want)
    if backend_name == "FLASHINFER":
        assert torch.equal(got.paged_kv_indices, want.paged_kv_indices)


def test_a_refused_step_leaves_the_duplicate_check_exact():
    # the check marks blocks in a bitmap the builder keeps: a mark left behind by a refused step
    # (block 3 here) would make the next step's marks as many as its entries, hiding its duplicate
    b = builder()
    for table, block in (([[3, 3, 4]], 3), ([[2, 4, 4]], 4)):
        with pytest.raises(ValueError, match=f"names block {block} twice"):
            b.build(np.array([9]), np.array([1]), np.array(table))
    for bad in ([[3, 4, NB]], [[-1, 4, 5]]):  # refused before any mark
        with pytest.raises(ValueError, match="outside the cache"):
            b.build(np.array([9]), np.array([1]), np.array(bad))
    assert b.build(np.array([9]), np.array([1]), np.array([[3, 4, 5]])).block_tables.tolist() == [[3, 4, 5]]


@pytest.mark.parametrize("lens", [np.array([9, 2**40]), torch.tensor([9, 2**40])], ids=["numpy", "tensor"])
def test_array_lengths_past_int32_raise_like_lists(lens):
    with pytest.raises(ValueError, match=r"seq_lens must hold ints within int32 .* got 1099511627776"):
        builder().build(lens, [1, 1], [[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match=r"seq_lens must hold ints within int32 .* got 1099511627776"):
        builder().build(lens.tolist(), [1, 1], [[1, 2, 3], [4, 5, 6]])


def _whole_check(table: np.ndarray, seq: np.ndarray, rolled: np.ndarray | None) -> object:
    """What a fresh `check_block_ids` says of a step: shared or not, or the error's message."""
    _, ids, row_ends, _ = needed_table(table, seq, BS, "block_tables", rolled)
    try:
        return check_block_ids(ids, row_ends, NB, "block_tables")
    except ValueError as e:
        return str(e)


def test_a_kept_block_check_judges_each_step_as_a_whole_check_does(monkeypatch):
    """`BlockIdCheck` over random step sequences: decodes growing into new blocks (its fast path),
    new blocks that repeat a read block, leave the cache or wrap into it from an int64 table,
    edited entries (kept ones wrapping too), batches that change or shrink, prefix sharing,
    rolling (sliding-window) tables whose window moves both ways: every step gets the whole
    check's verdict and message. Then a run of pure decode
    steps makes a single whole check."""
    rng = np.random.default_rng(11)
    for trial in range(300):
        check = BlockIdCheck(NB)
        n = int(rng.integers(1, 5))
        table = rng.permutation(NB)[: n * 8].reshape(n, 8).astype(np.int64 if trial % 3 else np.int32)
        seq = rng.integers(2, 4 * BS, n)
        window = None if trial % 4 else int(rng.integers(2, 3 * BS))
        for step in range(10):
            move = rng.integers(7)
            if move == 0:  # a new block repeats one of the step's, leaves the cache or wraps into it
                i = int(rng.integers(n))
                need = -(-seq[i] // BS)
                if need < 8:
                    bad = [table[int(rng.integers(n)), 0], NB, -1, int(rng.integers(NB))]
                    table[i, need] = rng.choice(bad + [2**32 + 3] * (table.dtype == np.int64))
            elif move == 1:  # an edited entry, or one that wraps into the cache from an int64 table
                table[rng.integers(n), rng.integers(8)] = rng.integers(NB) + 2**32 * (table.dtype == np.int64
                                                                                        and rng.random() < 0.3)
            elif move == 2 and n > 1:  # a request leaves
                keep = np.arange(n) != rng.integers(n)
                table, seq, n = table[keep].copy(), seq[keep], n - 1
            elif move == 3:  # a shorter request in some row
                seq[rng.integers(n)] = rng.integers(2, BS + 2)
            elif move == 4:  # every request enters a new block, all of them the same one
                need = -(-seq // BS)
                grow = need < 8
                table[np.flatnonzero(grow), need[grow]] = rng.integers(NB)
                seq = np.where(grow, need * BS + 1, seq)
            seq = np.minimum(seq + rng.integers(0, BS, n) * (move >= 5), 8 * BS)  # decodes, some crossing a block
            starts = seq - rng.integers(1, seq + 1) if rng.random() < 0.3 else seq - 1  # chunks, else decodes
            rolled = None if window is None else rolled_blocks(starts, window, BS)
            want = _whole_check(table, seq, rolled)
            padded, ids, row_ends, _ = needed_table(table, seq, BS, "block_tables", rolled)
            try:
                got = check(padded, -(-seq // BS), ids, row_ends, "block_tables", rolled)
            except ValueError as e:
                got = str(e)
            assert got == want, (trial, step)
    calls = []
    monkeypatch.setattr(block_ids, "check_block_ids", lambda *a, **k: calls.append(1) or check_block_ids(*a, **k))
    check, table, seq = BlockIdCheck(NB), np.arange(32, dtype=np.int32).reshape(4, 8), np.array([2, 5, 9, 3])
    for _ in range(20):
        seq += 1
        padded, ids, row_ends, _ = needed_table(table, seq, BS, "block_tables")
        assert check(padded, -(-seq // BS), ids, row_ends, "block_tables") is False
    assert len(calls) == 1


def test_a_decode_growing_into_a_repeated_block_raises_as_a_fresh_builder_does():
    b = builder()
    table = np.array([[3, 4, 5, 17], [6, 7, 8, 19]], dtype=np.int32)
    for seq in (np.array([13, 10]), np.array([14, 11]), np.array([15, 12])):
        b.build(seq, np.array([1, 1]), table)
    table[1, 3] = 17  # request 1's next block is request 0's last
    seq = np.array([16, 13])  # request 1 enters its fourth block and writes there
    with pytest.raises(ValueError, match="block 17") as fresh:
        builder().build(seq, np.array([1, 1]), table)
    with pytest.raises(ValueError, match="block 17") as kept:
        b.build(seq, np.array([1, 1]), table)
    assert str(kept.value) == str(fresh.value)


@pytest.mark.parametrize("tables", [lambda t: t, lambda t: t.tolist()], ids=["array", "lists"])
def test_a_kept_entry_edited_past_int32_raises_as_a_fresh_builder_does(tables):
    """An id 2**32 + 1 where the last step read block 1: int32 would read it as block 1."""
    b, table = builder(), np.array([[1, 2, 3, 0]], dtype=np.int64)
    b.build(np.array([12]), np.array([1]), tables(table))
    table[0, 0] = 1 + 2**32
    with pytest.raises(ValueError, match="names block 4294967297"):
        b.build(np.array([13]), np.array([1]), tables(table))


def test_a_rolling_window_moving_back_is_checked_whole():
    """A chunk that starts before the last decode's window re-reads a row's leading block 0,
    which request 0 writes: the kept check must not have let the earlier step's marks decide."""
    spec = ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, block_size=16, num_blocks=NB,
                            dtype=torch.float32, device="cpu", sliding_window=32)
    table = np.array([[0, 9, 10, 11, 12], [0, 0, 0, 7, 8]], dtype=np.int32)
    b = BACKEND.get_builder_cls()(spec, rolling_tables=True)
    b.build([80, 80], [80, 1], table)
    with pytest.raises(ValueError, match="block 0") as fresh:
        BACKEND.get_builder_cls()(spec, rolling_tables=True).build([80, 80], [80, 17], table)
    with pytest.raises(ValueError, match="block 0") as kept:
        b.build([80, 80], [80, 17], table)
    assert str(kept.value) == str(fresh.value)


def test_packed_copy_views_every_array_back_from_one_aligned_copy():
    rng = np.random.default_rng(11)
    arrays = {
        "a": rng.integers(-2**31, 2**31 - 1, 7, dtype=np.int64).astype(np.int32),
        "b": rng.integers(-2**62, 2**62, (3, 5), dtype=np.int64),
        "empty": np.zeros((0, 4), dtype=np.int32),
        "strided": rng.integers(0, 1000, (6, 4), dtype=np.int64).astype(np.int32)[::2, 1:],  # not contiguous
        "c": rng.integers(0, 9, 1, dtype=np.int64),
    }
    copies = []
    out = packed_copy(arrays, lambda host: copies.append(host) or host.clone())  # a stand-in device copy
    assert len(copies) == 1 and list(out) == list(arrays)
    assert {t.untyped_storage().data_ptr() for t in out.values()} == {out["a"].untyped_storage().data_ptr()}
    for name, a in arrays.items():
        t = out[name]
        assert t.dtype == {np.int32: torch.int32, np.int64: torch.int64}[a.dtype.type], name
        assert t.shape == a.shape and np.array_equal(t.numpy(), a), name
        assert t.storage_offset() * t.element_size() % UPLOAD_ALIGN == 0, name
    assert packed_copy({}, lambda host: pytest.fail("copied nothing")) == {}


def test_upload_refuses_other_dtypes_on_every_device():
    for device in ("cpu", "meta"):
        with pytest.raises(TypeError, match="device field mask must be an int32 or int64 array, got bool"):
            upload({"ok": np.zeros(2, np.int32), "mask": np.zeros(2, bool)}, torch.device(device))


def test_upload_copies_to_other_devices_and_shares_cpu_arrays():
    a, b = np.arange(5, dtype=np.int32), np.arange(6, dtype=np.int64).reshape(2, 3)
    meta = upload({"a": a, "b": b}, torch.device("meta"))
    assert [(t.device.type, t.dtype, t.shape) for t in meta.values()] == [
        ("meta", torch.int32, (5,)), ("meta", torch.int64, (2, 3))]
    cpu = upload({"a": a, "b": b}, torch.device("cpu"))
    assert np.shares_memory(cpu["a"].numpy(), a) and np.shares_memory(cpu["b"].numpy(), b)  # no copy on CPU
    b.flags.writeable = False  # a builder's frozen table: copied, as no tensor may view read-only memory
    cpu = upload({"a": a, "b": b}, torch.device("cpu"))
    assert np.shares_memory(cpu["a"].numpy(), a) and not np.shares_memory(cpu["b"].numpy(), b)
    assert cpu["b"].tolist() == b.tolist()


@pytest.fixture
def packed_copies(monkeypatch) -> list[list[str]]:
    """The field names each `packed_copy` (one device upload) copies, sorted, in call order."""
    copies = []

    def spy(arrays, copy, **kw):
        copies.append(sorted(arrays))
        return packed_copy(arrays, copy, **kw)

    monkeypatch.setattr(ca.metadata, "packed_copy", spy)
    return copies


@pytest.mark.parametrize(("backend_name", "fields"), [
    ("TORCH_SDPA", ("prefill_token_index", "prefill_q_pos", "prefill_flat_index")),
    ("FLASHINFER", ("paged_kv_indices",)),
])
def test_every_device_field_of_a_step_comes_from_one_copy(backend_name, fields, packed_copies):
    copies = packed_copies
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=BS, num_blocks=NB,
                            dtype=torch.bfloat16, device="meta")  # a device copy on a CPU-only machine
    b = ca.registry.BACKEND_CLASSES()[backend_name].get_builder_cls()(spec)
    # a prefill with a cached prefix and a decode whose table holds entries past its need: the
    # page list is not the table read row by row, and TORCH_SDPA lays out its prefill
    md = b.build([9, 5], [3, 1], [[10, 3, 8], [0, 21, 30]])
    assert copies == []  # made when a device field is first read
    common = ("slot_mapping", "seq_lens_tensor", "context_lens_tensor", "query_start_loc", "block_tables")
    assert all(getattr(md, name).device.type == "meta" for name in common + fields)
    assert len(copies) == 1 and set(copies[0]) == set(common + fields)
    if backend_name == "FLASHINFER":
        assert md.paged_kv_indices.shape == (5,)  # the pages read: 3 + 2, not the table's 6


def test_device_fields_wait_for_their_first_read_and_come_from_one_copy(packed_copies):
    copies = packed_copies
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=BS, num_blocks=NB,
                            dtype=torch.bfloat16, device="meta")
    rng = np.random.default_rng()
    seq_lens = rng.integers(2, 3 * BS, size=3)
    tables = rng.permutation(NB)[: 3 * 3].reshape(3, 3)
    md = ca.registry.BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(spec).build(seq_lens, np.ones(3, int), tables)
    # what asks without uploading
    assert md.device == torch.device("meta") and md.has("block_tables") and not md.has("cross_block_tables")
    assert not md.is_uploaded("slot_mapping") and copies == []
    assert md.block_tables.shape == (3, int(max(-(-seq_lens // BS))))  # one read uploads every field
    common = ["block_tables", "context_lens_tensor", "query_start_loc", "seq_lens_tensor", "slot_mapping"]
    assert copies == [common] and md.is_uploaded("slot_mapping")
    md.upload_pending()  # done: no second copy
    assert md.seq_lens_tensor.device.type == "meta" and len(copies) == 1
    # a variant reads every field of the original (uploaded) and has nothing pending
    cpu_spec = dataclasses.replace(spec, device="cpu")
    cpu_md = ca.registry.BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(cpu_spec).build(
        seq_lens, np.ones(3, int), tables)
    variant = dataclasses.replace(cpu_md, max_query_len=1)
    assert cpu_md.is_uploaded("slot_mapping") and variant.is_uploaded("slot_mapping")
    assert variant.seq_lens_tensor.tolist() == seq_lens.tolist()
    assert variant.context_lens_tensor.tolist() == (seq_lens - 1).tolist()


@pytest.mark.parametrize("backend_name", ["FLASHINFER", "TORCH_SDPA"])
@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("full", [False, True])  # every row needs the whole table: no masking copy
@pytest.mark.parametrize("dtype", [np.int32, np.int64])  # an int64 table's ids keep its dtype (no narrowing copy)
def test_a_deferred_upload_copies_the_step_as_built_though_the_caller_edits_its_arrays(backend_name, as_tensor, full,
                                                                                        dtype):
    # a server edits its tables and lengths arrays in place for the next step, before this one's
    # upload (its first device-field read) has run
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=BS, num_blocks=NB,
                            dtype=torch.float32, device="cpu")
    rng = np.random.default_rng()
    seq_lens = rng.integers(3 * BS + 1 if full else 2, 4 * BS + 1, size=3)
    tables = rng.permutation(NB)[:12].reshape(3, 4).astype(dtype)
    want_tables = [list(t[: -(-s // BS)]) for t, s in zip(tables.tolist(), seq_lens.tolist(), strict=True)]
    want_slots = [t[(s - 1) // BS] * BS + (s - 1) % BS for t, s in zip(want_tables, seq_lens.tolist(), strict=True)]
    given = (torch.from_numpy(seq_lens), torch.from_numpy(tables)) if as_tensor else (seq_lens, tables)
    md = ca.registry.BACKEND_CLASSES()[backend_name].get_builder_cls()(spec).build(given[0], np.ones(3, int), given[1])
    seq_lens[:] += 1
    tables[:] = 0
    # the ids FLASHINFER's own graphed decode copies into its page list: the builder's, not the caller's
    assert md.needed_block_ids().tolist() == [b for row in want_tables for b in row]
    assert not md.is_uploaded("block_tables")
    assert [row[: len(w)] for row, w in zip(md.block_tables.tolist(), want_tables, strict=True)] == want_tables
    assert md.slot_mapping.tolist() == want_slots
    assert md.seq_lens_tensor.tolist() == (seq_lens - 1).tolist()


def _sdpa_step(seq_lens: list[int]) -> ca.AttentionMetadata:
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=BS, num_blocks=NB,
                            dtype=torch.float32, device="cpu")
    tables = np.random.default_rng().permutation(NB)[: 4 * len(seq_lens)].reshape(len(seq_lens), 4)
    return ca.registry.BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(spec).build(seq_lens, [1] * len(seq_lens),
                                                                                      tables)


def test_a_failed_upload_is_made_again_at_the_next_read_and_keeps_assigned_fields(monkeypatch):
    md = _sdpa_step([5, 9, 14])
    real, calls = ca.metadata.upload, []

    def failing_once(arrays, device):
        calls.append(device)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("out of pinned memory")
        return real(arrays, device)

    monkeypatch.setattr(ca.metadata, "upload", failing_once)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        md.seq_lens_tensor  # noqa: B018
    assert not md.is_uploaded("seq_lens_tensor") and md.has("slot_mapping")
    mine = torch.tensor([7, 7, 7], dtype=torch.int32)
    md.context_lens_tensor = mine  # assigned before the upload: the upload leaves it
    assert md.seq_lens_tensor.tolist() == [5, 9, 14] and len(calls) == 2
    assert md.context_lens_tensor is mine and md.query_start_loc.tolist() == [0, 1, 2, 3]


def test_a_first_read_under_fake_tensor_mode_or_from_two_threads_uploads_real_tensors_once(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    md = _sdpa_step([5, 9])
    with FakeTensorMode():  # e.g. a trace that hands the ops their metadata
        fake_mode_read = md.seq_lens_tensor
    assert not isinstance(fake_mode_read, FakeTensor) and md.seq_lens_tensor.tolist() == [5, 9]

    md = _sdpa_step([6, 10, 3])
    real, uploads, entered, proceed = ca.metadata.upload, [], threading.Event(), threading.Event()

    def held(arrays, device):  # an upload in flight until the test lets it finish
        uploads.append(device)
        entered.set()
        assert proceed.wait(10)
        return real(arrays, device)

    monkeypatch.setattr(ca.metadata, "upload", held)
    reads, reading = {}, threading.Event()

    def read_second() -> None:
        reading.set()  # from here on the thread is in its first read
        reads["second"] = md.seq_lens_tensor.tolist()

    first = threading.Thread(target=lambda: reads.setdefault("first", md.slot_mapping.tolist()))
    second = threading.Thread(target=read_second)
    first.start()
    assert entered.wait(10)
    second.start()
    assert reading.wait(10)
    time.sleep(0.2)  # time for an unlocked read to have started a second upload (it would block in `held`)
    assert "second" not in reads  # it waits for the upload in flight
    proceed.set()
    first.join(10)
    second.join(10)
    assert reads == {"first": md.slot_mapping.tolist(), "second": [6, 10, 3]} and len(uploads) == 1


def test_a_deferred_upload_names_the_device_with_its_index(monkeypatch):
    # what md.device says before the upload, compared with the graph buffers' (`cuda:0`) device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert indexed_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert indexed_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert indexed_device(torch.device("cpu")) == torch.device("cpu")
    # build() defers to the indexed device (a CUDA spec cannot be built here: a stand-in for it)
    monkeypatch.setattr(ca.metadata, "indexed_device", lambda device: torch.device("meta"))
    md = _sdpa_step([5, 9])
    assert md.device == torch.device("meta") and md.slot_mapping.device.type == "meta"


def test_add_backend_fields_gets_the_steps_checked_host_inputs(monkeypatch):
    """The hook every backend implements reads one HostStep: the lengths, the prefill count and
    the builder's checked tables (padded, block 0 past each need), cross attention's too."""
    steps = []
    monkeypatch.setattr(type(builder(T.ENCODER_DECODER)), "add_backend_fields",
                        lambda self, step: steps.append(step) or {})
    tables = np.array([[10, 3, 8, 99], [0, 21, 98, 97], [5, 6, 96, 95]])
    builder(T.ENCODER_DECODER).build([9, 5, 7], [3, 5, 1], tables, encoder_seq_lens=[5, 3, 2],
                                     cross_block_tables=[[11, 12], [13], [15, 16, 17]])
    (step,) = steps
    assert isinstance(step, ca.metadata.HostStep)
    assert (step.seq_lens, step.query_lens, step.num_prefills, step.encoder_seq_lens) == ([9, 5, 7], [3, 5, 1], 2,
                                                                                           [5, 3, 2])
    assert step.block_table.tolist() == [[10, 3, 8], [0, 21, 0], [5, 6, 0]]
    assert step.block_ids.tolist() == [10, 3, 8, 0, 21, 5, 6]
    assert step.cross_block_table.tolist() == [[11, 12], [13, 0], [15, 0]]


def test_an_upload_of_a_field_not_declared_a_device_field_raises(monkeypatch):
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=BS, num_blocks=NB,
                            dtype=torch.float32, device="cpu")
    builder = ca.registry.BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(spec)
    # a backend field uploaded with the step's copy must be a DeviceField, or nothing would upload it on its read
    monkeypatch.setattr(type(builder), "add_backend_fields", lambda self, step: {"extra_rows": np.zeros(2, np.int64)})
    with pytest.raises(TypeError, match=r"must declare its uploaded fields \['extra_rows'\] as DeviceField\(None\)"):
        builder.build([5, 9], [1, 1], [[1, 2], [3, 4, 5]])
    assert isinstance(vars(ca.metadata.CommonMetadata)["slot_mapping"], DeviceField)


def test_flashinfer_page_list_of_full_tables_is_the_table_itself(packed_copies):
    copies = packed_copies
    for device in ("meta", "cpu"):
        spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=BS, num_blocks=NB,
                                dtype=torch.bfloat16, device=device)
        b = ca.registry.BACKEND_CLASSES()["FLASHINFER"].get_builder_cls()(spec)
        md = b.build([2 * BS, 2 * BS - 1], [1, 1], [[4, 9], [17, 2]])  # every entry read
        assert md.paged_kv_indices.shape == (4,)
        if device == "cpu":
            assert md.paged_kv_indices.data_ptr() == md.block_tables.data_ptr()
            assert md.paged_kv_indices.tolist() == [4, 9, 17, 2]
    assert len(copies) == 1 and "paged_kv_indices" not in copies[0]  # meta only: CPU does not copy


@pytest.mark.gpu
def test_a_builders_metadata_first_read_inside_a_capture_raises_naming_the_fix():
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=BS, num_blocks=NB,
                            dtype=torch.bfloat16, device="cuda")
    seq_lens = np.random.default_rng().integers(2, 4 * BS, size=3)
    md = ca.registry.BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(spec).build(
        seq_lens, np.ones(3, int), np.arange(12).reshape(3, 4))
    fix = r"graph_capture_get_metadata_for_batch.*md.upload_pending\(\)"
    with torch.cuda.graph(torch.cuda.CUDAGraph()), pytest.raises(RuntimeError, match=fix):
        md.seq_lens_tensor  # noqa: B018
    assert md.seq_lens_tensor.tolist() == seq_lens.tolist()  # read after the capture: uploaded then


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["TORCH_SDPA", "FLASHINFER", "XFORMERS"])
def test_cuda_fields_equal_cpu_fields_from_one_pinned_copy(backend_name):
    from torch.profiler import ProfilerActivity, profile

    bs = 64 if backend_name == "XFORMERS" else BS
    specs = [ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=bs, num_blocks=NB,
                              dtype=torch.bfloat16, device=device) for device in ("cpu", "cuda")]
    builders = [ca.registry.BACKEND_CLASSES()[backend_name].get_builder_cls()(spec) for spec in specs]
    rng = np.random.default_rng(5)
    seq = np.array([2 * bs + 3, 3 * bs, bs + 1])
    table = rng.permutation(NB)[:12].reshape(3, 4).astype(np.int32)  # entries past each need: a page list
    query = np.array([5, 1, 1])
    want = builders[0].build(seq, query, table)
    built = builders[1].build(seq, query, table)  # allocations and lazy set-up outside the profile
    if backend_name == "FLASHINFER" and fib.plans_in_build(specs[1]):  # where FlashInfer loads: planned,
        assert built.is_uploaded("slot_mapping") and built.step_plan.is_planned(built)  # so uploaded, in build()
    built.upload_pending()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # build_view: the step without FlashInfer's plan (whose copies are FlashInfer's own)
        got = builders[1].build_view(seq, query, table)
        got.upload_pending()  # what the first device-field read does
        torch.cuda.synchronize()
    copies = [k.name for k in cuda_kernels(prof) if k.name.startswith("Memcpy HtoD")]
    # one copy for every backend: XFORMERS' own fields (this step has a prefill with a cached prefix) travel in it
    assert copies == ["Memcpy HtoD (Pinned -> Device)"], copies
    want.upload_pending()
    fields = [f for f, v in vars(want).items()
              if isinstance(v, torch.Tensor) and isinstance(getattr(got, f), torch.Tensor) and getattr(got, f).is_cuda]
    assert {"slot_mapping", "block_tables", "seq_lens_tensor", "query_start_loc"} <= set(fields)
    for f in fields:
        t = getattr(got, f)
        assert t.data_ptr() % UPLOAD_ALIGN == 0, f
        assert torch.equal(t.cpu(), getattr(want, f)), f
        assert torch.equal(getattr(built, f).cpu(), getattr(want, f)), f  # build()'s own upload too

"""GraphState, the one CUDA-graph State of every backend, on CPU.

Structure (each backend's State is GraphState plus hooks), what a State captures (data on the
backend class), and the buffers every backend's State fills through `CUDAGraphRunner`'s
static-buffer step (`use_cuda_graphs=False`, the computation a replay runs): live rows copied,
pad rows write nothing and read SCRATCH_BLOCK, rows of an earlier, larger step never survive.
FlashInfer runs on CPU with conftest's recording stand-in, or test_flashinfer's dense one.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable

import pytest
import torch
import toy_backend
from test_flashinfer import DENSE_FLASHINFER

import compiled_attn as ca
from compiled_attn.backends import flashinfer as fib
from compiled_attn.graph_state import SCRATCH_BLOCK, GraphState, StaticInputs, table_widths
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.metadata import UPLOAD_ALIGN
from compiled_attn.registry import BACKEND_CLASSES

T = ca.AttentionType
HOOKS = {"allocate_extra", "make_for_batch", "add_graph_fields", "host_rows", "copy_extra", "plan", "ROW_PADS",
         "TABLES", "MIN_TABLE_WIDTH_TOKENS"}


def spec_for(**kw) -> ca.AttentionSpec:
    base = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=64, num_blocks=64, dtype=torch.bfloat16,
                device="cpu", max_seq_len_to_capture=192)  # 3 blocks per request
    return ca.AttentionSpec(**{**base, **kw})


def static_runner(model, name: str, spec: ca.AttentionSpec, caches: list[torch.Tensor], sizes: list[int],
                  state: ca.AttentionState | None = None) -> CUDAGraphRunner:
    runner = CUDAGraphRunner(model, BACKEND_CLASSES()[name], spec, caches, state, capture_sizes=sizes,
                             max_batch_size=max(sizes), use_cuda_graphs=False, progress=False)
    runner.capture()
    return runner


def enter_capture(state: ca.AttentionState) -> None:
    with state.graph_capture(2):
        pass


# -------------------------------------------------------------------------------------------
# Structure and capture data


def test_backend_states_override_hooks_only(contract_backend):
    backend = contract_backend
    state_cls = backend.get_state_cls()
    assert issubclass(state_cls, GraphState) and state_cls.backend_cls is backend
    own = set(vars(state_cls)) - set(vars(type("NoHooks", (GraphState,), {})))  # drops what any subclass gets
    overridden = {attr for attr in own if hasattr(GraphState, attr)} - {"__init__"}  # __init__ may add fields
    assert overridden <= HOOKS, f"{state_cls.__name__} redefines {sorted(overridden - HOOKS)} of GraphState"
    public = {attr for attr in own if not attr.startswith("_")}
    assert public <= HOOKS | {"backend_cls"}, f"{state_cls.__name__} adds {sorted(public - HOOKS)}"


@pytest.mark.parametrize("attn_type", list(T))
def test_graph_capture_serves_the_attention_types_its_backend_declares(contract_backend, attn_type):
    backend, name = contract_backend, contract_backend.get_name()
    spec = spec_for(attn_type=attn_type)
    state = backend.get_state_cls()(spec)
    if attn_type in backend.graph_attn_types:
        enter_capture(state)
        return
    # backends named instead capture the type and serve the rest of the spec (a CPU one, here)
    capturers = [n for n, b in BACKEND_CLASSES().items() if attn_type in b.graph_attn_types
                 and b.unsupported_reason(spec) is None]
    hint = f"use {' or '.join(capturers)}" if capturers else "run these steps eagerly"
    with pytest.raises(NotImplementedError, match=f"^{name} .*; {hint}$"):
        enter_capture(state)


def test_a_refused_capture_names_no_backend_that_refuses_the_rest_of_the_spec():
    # XFORMERS captures cross decode, but not in fp32, on CPU or with soft-cap
    spec = spec_for(dtype=torch.float32, logits_soft_cap=30.0, attn_type=T.ENCODER_DECODER)
    with pytest.raises(NotImplementedError, match=r"^TORCH_SDPA captures .*ENCODER_DECODER; run these steps eagerly$"):
        enter_capture(BACKEND_CLASSES()["TORCH_SDPA"].get_state_cls()(spec))


def test_xformers_state_refuses_alibi_naming_states_that_capture_it():
    state = BACKEND_CLASSES()["XFORMERS"].get_state_cls()(spec_for(alibi_slopes=torch.ones(8)))
    with pytest.raises(NotImplementedError, match="ALiBi eagerly only.*; use TORCH_SDPA$"):  # a CPU spec
        enter_capture(state)


def test_xformers_state_refuses_block_sizes_its_decode_kernel_cannot_read():
    state = BACKEND_CLASSES()["XFORMERS"].get_state_cls()(spec_for(block_size=16))
    with pytest.raises(NotImplementedError, match="block_size=16; use TORCH_SDPA$"):  # a CPU spec: not FLASHINFER
        enter_capture(state)


# -------------------------------------------------------------------------------------------
# Lifecycle (TORCH_SDPA's State: GraphState over the common buffers)


def sdpa_state():
    return BACKEND_CLASSES()["TORCH_SDPA"].get_state_cls()(spec_for(dtype=torch.float32))


def test_buffers_are_allocated_once_while_big_enough():
    state = sdpa_state()
    with state.graph_capture(4):
        big = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(4))
    with state.graph_capture(2):
        small = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2))
    assert all(small[k].data_ptr() == big[k].data_ptr() for k in big)


def test_graph_input_buffers_before_graph_capture_raises():
    state = sdpa_state()
    md = BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(state.spec).build([70], [1], [[5, 6]])
    with pytest.raises(RuntimeError, match="^get_graph_input_buffers before graph_capture allocated the buffers$"):
        state.get_graph_input_buffers(md)


def test_graph_clone_before_the_metadata_of_its_size_raises():
    state = sdpa_state()
    with state.graph_capture(4), pytest.raises(RuntimeError, match=r"graph_clone\(2\) before .*_for_batch\(2\)"):
        state.graph_capture_get_metadata_for_batch(4)
        state.graph_clone(2)


def test_prepare_with_buffers_of_another_size_raises_and_writes_nothing():
    state = sdpa_state()
    with state.graph_capture(4):
        bufs = {bs: state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(bs)) for bs in (4, 2)}
        clone_2 = state.graph_clone(2)
    md = BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(state.spec).build([70], [1], [[5, 6]])
    before = {k: t.clone() for k, t in bufs[4].items()}
    with pytest.raises(RuntimeError, match="batch size 4, which this state did not capture"):
        clone_2.prepare_graph_input_buffers(bufs[4], md)
    assert all(torch.equal(bufs[4][k], before[k]) for k in before)


def test_prepare_with_buffers_of_another_state_raises():
    bufs, clones = [], []
    for state in (sdpa_state(), sdpa_state()):
        with state.graph_capture(2):
            bufs.append(state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2)))
            clones.append(state.graph_clone(2))
    md = BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(clones[0].spec).build([70], [1], [[5, 6]])
    with pytest.raises(RuntimeError, match="not this state's"):
        clones[1].prepare_graph_input_buffers(bufs[0], md)
    clones[1].prepare_graph_input_buffers(bufs[1], md)


def test_prepare_with_metadata_on_another_device_raises_and_writes_nothing():
    """Metadata built for the same cache on another device (meta stands in for another GPU)."""
    state = sdpa_state()
    with state.graph_capture(2):
        bufs = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2))
        clone = state.graph_clone(2)
    builder = BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(dataclasses.replace(state.spec, device="meta"))
    md = builder.build([70], [1], [[5, 6]])
    before = {k: t.clone() for k, t in bufs.items()}
    with pytest.raises(ValueError, match="^metadata on meta, graph buffers on cpu$"):
        clone.prepare_graph_input_buffers(bufs, md)
    assert all(torch.equal(bufs[k], before[k]) for k in before)


@pytest.mark.parametrize(("name", "graph_options", "field"), [
    ("XFORMERS", {"attn_type": T.ENCODER_DECODER}, "encoder_seq_lens_tensor"),  # cross graphs
    ("TORCH_SDPA", {}, "context_lens_tensor"),
])
def test_prepare_with_metadata_lacking_a_field_the_graph_reads_raises_and_writes_nothing(name, graph_options, field):
    backend = BACKEND_CLASSES()[name]
    spec = spec_for(**graph_options)
    state = backend.get_state_cls()(spec)
    with state.graph_capture(2):
        bufs = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2))
        clone = state.graph_clone(2)
    cross = {"encoder_seq_lens": [9], "cross_block_tables": [[3]]} if graph_options else {}
    md = dataclasses.replace(backend.get_builder_cls()(spec).build([70], [1], [[5, 6]], **cross), **{field: None})
    before = {k: t.clone() for k, t in bufs.items()}
    with pytest.raises(ValueError, match=f"^the graph reads {field}, which this metadata lacks: build it for the "
                                         "graph's spec"):
        clone.prepare_graph_input_buffers(bufs, md)
    assert all(torch.equal(bufs[k], before[k]) for k in before)


def test_prepare_with_decoder_metadata_for_cross_graphs_raises_and_writes_nothing():
    backend = BACKEND_CLASSES()["XFORMERS"]
    state = backend.get_state_cls()(spec_for(attn_type=T.ENCODER_DECODER))
    with state.graph_capture(2):
        bufs = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2))
        clone = state.graph_clone(2)
    md = backend.get_builder_cls()(spec_for()).build([70], [1], [[5, 6]])  # a decoder spec of the same cache
    before = {k: t.clone() for k, t in bufs.items()}
    with pytest.raises(ValueError, match=r"^metadata built for another spec than the state's \(attn_type "):
        clone.prepare_graph_input_buffers(bufs, md)
    assert all(torch.equal(bufs[k], before[k]) for k in before)


def test_prepare_without_upload_writes_the_host_side_and_the_graphs_upload_copies_it(contract_backend,
                                                                                     fake_flashinfer):
    """What a captured upload relies on: prepare(upload=False) leaves every device buffer as it
    was; upload_graph_input_buffers (the graph's first node at replay) then makes them what
    prepare with its own upload makes, pads of an earlier, larger step included."""
    backend = contract_backend
    if backend.get_name() == "XFORMERS":
        pytest.importorskip("xformers.ops.fmha")
    rng = random.Random(3)
    states = [backend.get_state_cls()(spec_for()) for _ in range(2)]
    bufs, clones = [], []
    for state in states:
        with state.graph_capture(4):
            bufs.append(state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(4)))
            clones.append(state.graph_clone(4))
    builder = backend.get_builder_cls()(states[0].spec)
    for n in (4, 2):
        seq_lens = [rng.randint(2, 192) for _ in range(n)]
        blocks = rng.sample(range(1, 64), 3 * n)
        md = builder.build(seq_lens, [1] * n, [blocks[3 * i : 3 * i + 3] for i in range(n)])
        clones[0].prepare_graph_input_buffers(bufs[0], md)
        before = {k: t.clone() for k, t in bufs[1].items()}
        clones[1].prepare_graph_input_buffers(bufs[1], md, upload=False)
        assert all(torch.equal(bufs[1][k], before[k]) for k in before)
        assert clones[1].upload_graph_input_buffers(bufs[1]) is True
        for field in bufs[0]:
            assert torch.equal(bufs[1][field], bufs[0][field]), field
        assert not all(torch.equal(bufs[1][k], before[k]) for k in before), "the step changed no buffer"


def test_begin_forward_before_prepare_raises(contract_backend, fake_flashinfer):
    backend = contract_backend
    if backend.get_name() == "XFORMERS":
        pytest.importorskip("xformers.ops.fmha")
    state = backend.get_state_cls()(spec_for())
    with state.graph_capture(2):
        state.graph_capture_get_metadata_for_batch(2)
        clone = state.graph_clone(2)
    md = backend.get_builder_cls()(state.spec).build([70], [1], [[5, 6]])
    with pytest.raises(RuntimeError, match=r"prepare_graph_input_buffers\(bufs, md\) before begin_forward"):
        clone.begin_forward(md)


# -------------------------------------------------------------------------------------------
# Table widths: graphs over the first columns of the one block-table buffer


@pytest.mark.parametrize(("max_blocks", "block_size", "min_tokens", "widths"), [
    (64, 16, 256, (64, 32, 16)),
    (512, 16, 256, (512, 256, 128, 64, 32, 16)),  # the default max_seq_len_to_capture, 8192
    (100, 16, 256, (100, 64, 32, 16)),  # W itself, whatever it is
    (16, 16, 256, (16,)),  # the floor is the full table
    (8, 16, 256, (8,)),  # the floor is wider than the full table
    (100, 3, 256, (100, 86)),  # block sizes that do not divide the floor round it up
    (10, 4, None, (10,)),
])
def test_table_widths_double_from_the_floor_up_to_the_full_table(max_blocks, block_size, min_tokens, widths):
    assert table_widths(max_blocks, block_size, min_tokens) == widths


def wide_spec(**kw) -> ca.AttentionSpec:
    return spec_for(max_seq_len_to_capture=1024, **kw)  # 16 blocks of 64: widths 16, 8, 4 where declared


def test_only_the_gathering_kernel_declares_narrower_widths(contract_backend):
    backend = contract_backend
    widths = backend.get_state_cls()(wide_spec()).graph_table_widths()
    assert widths == ((16, 8, 4) if backend.get_name() == "TORCH_SDPA" else (16,))


def wide_sdpa_state():
    return BACKEND_CLASSES()["TORCH_SDPA"].get_state_cls()(wide_spec(dtype=torch.float32))


def test_metadata_of_a_width_views_the_first_columns_of_the_one_table():
    state = wide_sdpa_state()
    with state.graph_capture(4):
        full = state.graph_capture_get_metadata_for_batch(4)
        narrow = state.graph_capture_get_metadata_for_batch(2, table_width=8)
    full_bufs, narrow_bufs = state.get_graph_input_buffers(full), state.get_graph_input_buffers(narrow)
    assert full.block_tables.shape == (4, 16) and narrow.block_tables.shape == (2, 8)
    assert narrow.block_tables.stride() == full.block_tables.stride()  # a view of the same rows
    assert (full.max_seq_len, narrow.max_seq_len) == (1024, 8 * 64)  # the longest sequence each graph serves
    assert all(narrow_bufs[k].data_ptr() == full_bufs[k].data_ptr() for k in full_bufs)
    assert all(narrow_bufs[k].shape == full_bufs[k][:2].shape for k in full_bufs if k not in ("block_tables",
                                                                                           "query_start_loc"))


@pytest.mark.parametrize("width", [5, 17, 0, "8", 8.0])
def test_a_width_the_state_does_not_declare_raises(width):
    state = wide_sdpa_state()
    with state.graph_capture(2), pytest.raises(ValueError, match="table_width"):
        state.graph_capture_get_metadata_for_batch(2, table_width=width)


def test_every_state_refuses_the_widths_it_does_not_declare(contract_backend, fake_flashinfer):
    backend = contract_backend
    if backend.get_name() == "XFORMERS":
        pytest.importorskip("xformers.ops.fmha")
    state = backend.get_state_cls()(wide_spec())
    declared = state.graph_table_widths()
    with state.graph_capture(2):
        for width in set(range(1, 18)) - set(declared):  # FlashInfer's and xFormers' kernels read the whole table
            with pytest.raises(ValueError, match=rf"table_width={width} is not a width .*{list(declared)}"):
                state.graph_capture_get_metadata_for_batch(2, table_width=width)


def test_graph_clone_before_the_metadata_of_its_width_raises():
    state = wide_sdpa_state()
    with state.graph_capture(4):
        state.graph_capture_get_metadata_for_batch(4)  # the full width only
        with pytest.raises(RuntimeError, match=r"graph_clone\(4, table_width=8\) before "
                                               r"graph_capture_get_metadata_for_batch\(4, table_width=8\)"):
            state.graph_clone(4, table_width=8)
        state.graph_capture_get_metadata_for_batch(4, table_width=4)
        state.graph_clone(4, table_width=4)


def test_prepare_with_buffers_of_another_width_raises_and_writes_nothing():
    state = wide_sdpa_state()
    with state.graph_capture(4):
        bufs = {w: state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(4, table_width=w))
                for w in (16, 8)}
        clone_8 = state.graph_clone(4, table_width=8)
    md = BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(state.spec).build([70], [1], [[5, 6]])
    before = {k: t.clone() for k, t in bufs[16].items()}
    with pytest.raises(RuntimeError, match="table width 16, which this state did not capture"):
        clone_8.prepare_graph_input_buffers(bufs[16], md)
    assert all(torch.equal(bufs[16][k], before[k]) for k in before)


def test_prepare_refuses_a_step_wider_than_the_graphs_table_and_writes_nothing():
    state = wide_sdpa_state()
    with state.graph_capture(2):
        full = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2))
        bufs = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2, table_width=4))
        clone = state.graph_clone(2, table_width=4)
    builder = BACKEND_CLASSES()["TORCH_SDPA"].get_builder_cls()(state.spec)
    before = {k: t.clone() for k, t in full.items()}
    with pytest.raises(ValueError, match="block_tables of 5 blocks per request > the graph's 4"):
        clone.prepare_graph_input_buffers(bufs, builder.build([257, 9], [1, 1], [[1, 2, 3, 4, 5], [6]]))
    assert all(torch.equal(full[k], before[k]) for k in before)
    clone.prepare_graph_input_buffers(bufs, builder.build([256, 9], [1, 1], [[1, 2, 3, 4], [6]]))
    assert bufs["block_tables"].tolist() == [[1, 2, 3, 4], [6, 0, 0, 0]]
    assert full["block_tables"][:, 4:].eq(SCRATCH_BLOCK).all(), "columns past the width stay untouched"


@pytest.mark.parametrize("name", ["TORCH_SDPA", "FLASHINFER"])
def test_replaced_lengths_are_checked_against_the_table_and_served_from_themselves(name, fake_flashinfer):
    """Metadata made by `dataclasses.replace` with other lengths keeps the builder's frozen table
    and stale derived fields: its lengths are checked against that table and the capture limit
    before any buffer is written, and a step that fits is served from its own lengths."""
    import dataclasses

    spec = spec_for()
    state = BACKEND_CLASSES()[name].get_state_cls()(spec)
    with state.graph_capture(2):
        bufs = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2))
        clone = state.graph_clone(2)
    md = BACKEND_CLASSES()[name].get_builder_cls()(spec).build([17, 100], [1, 1], [[5], [7, 8]])
    before = {k: t.clone() for k, t in bufs.items()}
    for seq_lens, match in (([65, 100], "block_tables"), ([17, 200], "max_seq_len_to_capture=192"),
                            ([17, 150], r"block_tables: a \[2, >= 3\] table is needed, got \(2, 2\)")):
        with pytest.raises(ValueError, match=match):
            clone.prepare_graph_input_buffers(bufs, dataclasses.replace(md, seq_lens=seq_lens))
        assert all(torch.equal(bufs[k], before[k]) for k in before), seq_lens
    clone.prepare_graph_input_buffers(bufs, dataclasses.replace(md, seq_lens=[40, 128]))
    assert bufs["slot_mapping"].tolist() == [5 * 64 + 39, 8 * 64 + 63]
    assert bufs["seq_lens_tensor"].tolist() == [40, 128]
    if name == "FLASHINFER":  # the page CSR from the replaced lengths
        assert bufs["paged_kv_indptr"].tolist() == [0, 1, 3]
        assert bufs["paged_kv_last_page_len"][:2].tolist() == [40, 64]


# -------------------------------------------------------------------------------------------
# Buffers through the runner, every backend: a stand-in model records what the step reads

# One request grows from the first step to the second (its block table stays); the other rows of
# the first step are gone in the second, which runs in the same graph of 4: they must be pads.
FIRST = dict(seq_lens=[70, 3, 130, 65], tables=[[5, 6], [7], [8, 9, 10], [11, 12]],
             encoder_seq_lens=[100, 30, 64, 10], cross_block_tables=[[20, 21], [22], [23], [24]])
SECOND = dict(seq_lens=[71, 4], tables=[[5, 6], [7]], encoder_seq_lens=[100, 30], cross_block_tables=[[20, 21], [22]])
COMMON_AFTER_SECOND = {
    "slot_mapping": [6 * 64 + 6, 7 * 64 + 3, -1, -1],
    "seq_lens_tensor": [71, 4, 1, 1],
    "context_lens_tensor": [70, 3, 0, 0],
    "query_start_loc": [0, 1, 2, 3, 4],
    "block_tables": [[5, 6, 0], [7, 0, 0], [0, 0, 0], [0, 0, 0]],
}
# the backend's own graph inputs after SECOND: the leading entries a replay reads
OWN_AFTER_SECOND = {
    "sdpa": ("TORCH_SDPA", {}, {}),
    "flashinfer": ("FLASHINFER", {}, {"paged_kv_indices": [5, 6, 7, SCRATCH_BLOCK, SCRATCH_BLOCK],
                                      "paged_kv_indptr": [0, 2, 3, 4, 5], "paged_kv_last_page_len": [7, 4, 1, 1]}),
    "xformers_window": ("XFORMERS", {"sliding_window": 50}, {"decode_window_starts": [71 - 50, 0, 0, 0, 0]}),
    "xformers_cross": ("XFORMERS", {"attn_type": T.ENCODER_DECODER}, {
        "encoder_seq_lens_tensor": [100, 30, 1, 1],
        "cross_block_tables": [[20, 21, 0], [22, 0, 0], [0, 0, 0], [0, 0, 0]],
    }),
}


def recording_model(state: ca.AttentionState, seen: list[dict[str, torch.Tensor]]):
    """A model step that reads no attention: it records the graph inputs under the metadata it runs with."""
    def step(input_ids, positions, kv_caches):
        md = ca.get_forward_context().attn_metadata
        seen.append({name: t.clone() for name, t in state.get_graph_input_buffers(md).items()})
        return torch.zeros(input_ids.shape[0], 1)
    return step


def decode_step(builder, spec, step: dict) -> ca.AttentionMetadata:
    n = len(step["seq_lens"])
    cross = {"encoder_seq_lens": step["encoder_seq_lens"], "cross_block_tables": step["cross_block_tables"]}
    return builder.build(step["seq_lens"], [1] * n, step["tables"],
                         **(cross if spec.attn_type == T.ENCODER_DECODER else {}))


@pytest.mark.parametrize("case", list(OWN_AFTER_SECOND))
def test_runner_step_copies_live_rows_and_pads_the_rest(case, fake_flashinfer):
    name, options, own = OWN_AFTER_SECOND[case]
    if name == "XFORMERS":
        pytest.importorskip("xformers.ops.fmha")
    backend, spec = BACKEND_CLASSES()[name], spec_for(**options)
    state, seen = backend.get_state_cls()(spec), []
    runner = static_runner(recording_model(state, seen), name, spec, [], [4], state)
    builder = backend.get_builder_cls()(spec)
    for step in (FIRST, SECOND):
        tokens = torch.zeros(len(step["seq_lens"]), dtype=torch.int64)  # ids and positions: the model reads neither
        runner.run(decode_step(builder, spec, step), tokens, tokens)
    got = seen[-1]
    assert set(got) == set(COMMON_AFTER_SECOND) | set(own)
    for field, want in {**COMMON_AFTER_SECOND, **own}.items():
        assert got[field][: len(want)].tolist() == want, field


@pytest.mark.parametrize("case", list(OWN_AFTER_SECOND))
def test_a_graph_step_leaves_the_builders_upload_pending(case, fake_flashinfer):
    """A replay reads the step's host arrays (the State's mirror), so the builder's one upload is
    never made for it; XFORMERS's builder uploads at once (its biases hold device tensors)."""
    name, options, _ = OWN_AFTER_SECOND[case]
    if name == "XFORMERS":
        pytest.importorskip("xformers.ops.fmha")
    backend, spec = BACKEND_CLASSES()[name], spec_for(**options)
    state = backend.get_state_cls()(spec)
    runner = static_runner(recording_model(state, []), name, spec, [], [4], state)
    builder = backend.get_builder_cls()(spec)
    # the last step's tables are full: FlashInfer's page list is then the table itself, made at the upload
    full = dict(SECOND, seq_lens=[72, 100], tables=[[5, 6], [7, 8]])
    for i, step in enumerate((FIRST, SECOND, full)):
        md = decode_step(builder, spec, step)
        tokens = torch.zeros(md.num_seqs, dtype=torch.int64)
        runner.run(md, tokens, tokens)
        assert runner.counts["graph"] == i + 1 and md.is_uploaded("slot_mapping") == (name == "XFORMERS")
    # read after all, the fields are the step's
    assert md.slot_mapping.tolist() == [6 * 64 + 7, 8 * 64 + 35] and md.block_tables.tolist() == [[5, 6], [7, 8]]
    if name == "FLASHINFER":
        assert md.paged_kv_indices.tolist() == [5, 6, 7, 8]
        assert md.paged_kv_indices.data_ptr() == md.block_tables.data_ptr()


@pytest.mark.parametrize("case", list(OWN_AFTER_SECOND))
def test_runner_captures_a_graph_per_size_and_declared_width(case, fake_flashinfer):
    """FlashInfer's and xFormers' kernels read live lengths: one graph per size, over the full
    table; TORCH_SDPA's gather reads the table: a short step runs in its narrowest graph."""
    name, options, _ = OWN_AFTER_SECOND[case]
    if name == "XFORMERS":
        pytest.importorskip("xformers.ops.fmha")
    backend, spec = BACKEND_CLASSES()[name], wide_spec(**options)
    state, seen = backend.get_state_cls()(spec), []
    runner = static_runner(recording_model(state, seen), name, spec, [], [4, 2], state)
    widths = [16, 8, 4] if name == "TORCH_SDPA" else [16]
    assert runner.capture_stats["table_widths"] == widths and runner.capture_stats["num_graphs"] == 2 * len(widths)
    tokens = torch.zeros(len(FIRST["seq_lens"]), dtype=torch.int64)
    runner.run(decode_step(backend.get_builder_cls()(spec), spec, FIRST), tokens, tokens)  # 130 tokens: 3 blocks
    assert seen[-1]["block_tables"].shape == (4, widths[-1])


# -------------------------------------------------------------------------------------------
# The padded static step computes what eager does (TORCH_SDPA, FLASHINFER with dense attention,
# the toy backend)


class OneLayerStep:
    """A model step that is one DECODER attention layer over embeddings of the input ids."""

    def __init__(self, backend: type[ca.AttentionBackend], spec: ca.AttentionSpec, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        widths = (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
        self.q, self.k, self.v = (torch.randn(vocab, w * spec.head_size, generator=g) for w in widths)
        self.impl = backend.get_impl_cls()(spec.num_heads, spec.head_size, spec.softmax_scale,
                                           num_kv_heads=spec.num_kv_heads)
        self.layer_name, self._call = self.impl.register(1.0, 1.0, T.DECODER)  # _call keeps the name alive

    def __call__(self, input_ids, positions, kv_caches):
        return self.impl.run(self.q[input_ids], self.k[input_ids], self.v[input_ids], kv_caches[0], T.DECODER,
                             self.layer_name)


@pytest.mark.parametrize("contract_backend", ["TORCH_SDPA", "FLASHINFER", toy_backend.NAME], indirect=True)
def test_padded_static_step_equals_eager_and_pads_write_nothing(contract_backend, monkeypatch):
    runner = replays_against_eager(contract_backend, monkeypatch, lambda runner: None)
    assert runner.counts["graph"] == 5


def test_flashinfer_graphs_without_split_kv_keep_the_capture_plan(monkeypatch):
    """Without split-kv FlashInfer's schedule depends on the batch size alone: that graph's wrapper
    keeps its capture plan and each step refills only the page CSR (still equal to eager as the
    lengths change); a graph with split-kv plans every step (the split follows the lengths)."""
    monkeypatch.setattr(fib, "NO_SPLIT_KV_MIN_PAIRS", 8)  # 4 requests x 2 KV heads: none; 2 x 2: split
    plans_after_capture = {}

    def count_plans(runner: CUDAGraphRunner) -> dict[int, int]:
        return {bs: entry.graph_state._slots[bs].wrapper.num_plans for (bs, _), entry in runner._captured.items()}

    runner = replays_against_eager(BACKEND_CLASSES()["FLASHINFER"], monkeypatch,
                                   lambda r: plans_after_capture.update(count_plans(r)))
    assert count_plans(runner) == {4: plans_after_capture[4], 2: plans_after_capture[2] + 2}  # sizes 4, 4, 2, 2, 4


def replays_against_eager(backend: type[ca.AttentionBackend], monkeypatch,
                          after_capture: Callable[[CUDAGraphRunner], None]) -> CUDAGraphRunner:
    """Decode steps of 4, 3, 2, 1, 4 random requests through a one-layer model's static steps of
    sizes 4 and 2 (FLASHINFER with dense attention): each equals the eager step, pads write nothing."""
    name = backend.get_name()
    if name == "FLASHINFER":
        monkeypatch.setattr(fib, "_flashinfer", lambda: DENSE_FLASHINFER)
        monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
    spec, vocab = spec_for(dtype=torch.float32, block_size=16), 50
    model = OneLayerStep(backend, spec, vocab)
    shape = backend.get_kv_cache_shape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    cache = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    eager_cache = cache.clone()
    runner = static_runner(model, name, spec, [cache], [4, 2])
    after_capture(runner)
    builder, rng = backend.get_builder_cls()(spec), random.Random(0)
    for n in (4, 3, 2, 1, 4):  # fewer rows after more: stale rows of the graph of 4 become pads
        seq_lens = [rng.randint(2, spec.max_seq_len_to_capture) for _ in range(n)]
        blocks = rng.sample(range(spec.num_blocks), 12 * n)
        md = builder.build(seq_lens, [1] * n, [blocks[12 * i : 12 * (i + 1)] for i in range(n)])
        ids = torch.tensor([rng.randrange(vocab) for _ in range(n)])
        pos = torch.tensor(seq_lens) - 1
        with ca.set_forward_context(md):
            want = model(ids, pos, [eager_cache])
        torch.testing.assert_close(runner.run(md, ids, pos), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(cache, eager_cache), "a pad row wrote into the cache"
    return runner


def test_static_buffers_start_aligned_whatever_their_sizes():
    """Odd sizes of every element width: each view (and its host mirror) still starts on a
    UPLOAD_ALIGN boundary, holds its initial values and its pads."""
    parts = {"a": torch.arange(3, dtype=torch.int64), "b": torch.arange(5, dtype=torch.int32),
             "c": torch.arange(7, dtype=torch.int16), "d": torch.arange(6, dtype=torch.int32).view(2, 3),
             "e": torch.arange(1, dtype=torch.int32)}
    inputs = StaticInputs(parts, pads={"b": -1})
    base = inputs.views["a"].untyped_storage().data_ptr()
    for name, part in parts.items():
        view = inputs.views[name]
        assert (view.data_ptr() - base) % UPLOAD_ALIGN == 0, name
        assert inputs.host[name].ctypes.data % UPLOAD_ALIGN == inputs.host["a"].ctypes.data % UPLOAD_ALIGN, name
        assert torch.equal(view, torch.full_like(part, -1) if name == "b" else part), name


@pytest.mark.parametrize(("window", "built", "copied", "error"), [
    (None, ([17, 17], [1, 1]), dict(seq_lens=[16, 17]),
     "block_tables: block 5 is written this step by request 0 and named by request 1 too"),
    (None, ([17, 17], [1, 1]), dict(query_lens=[2, 0]), "a decode graph replays one new token per request"),
    (None, ([17, 17], [1, 1]), dict(seq_lens=[0, 17]), "a decode graph replays one new token per request"),
    (32, ([100, 17], [1, 1]), dict(seq_lens=[60, 17]),
     "block_tables: request 0's window reads from block entry 1, but its table freed the first 4"),
], ids=["writes-a-shared-block", "query-lens", "empty-sequence", "window-past-rolled-blocks"])
def test_a_copied_step_that_build_would_refuse_raises_and_writes_nothing(window, built, copied, error):
    """Metadata copied with other lengths (`dataclasses.replace`) is checked as `build()` checks
    a step: block 5, full and shared by both requests, is read-only; with rolling tables (window
    32, blocks of 16) a request of 100 tokens has freed its first 4 blocks, which 60 tokens read."""
    spec = spec_for(block_size=16, max_seq_len_to_capture=128, sliding_window=window)
    backend = BACKEND_CLASSES()["TORCH_SDPA"]
    state = backend.get_state_cls()(spec)
    with state.graph_capture(2):
        bufs = state.get_graph_input_buffers(state.graph_capture_get_metadata_for_batch(2))
        clone = state.graph_clone(2)
    builder = backend.get_builder_cls()(spec, rolling_tables=window is not None)
    tables = [[5, 6, 7, 8, 9, 10, 11], [5, 12]] if window else [[5, 6], [5, 7]]
    md = builder.build(*built, tables)
    clone.prepare_graph_input_buffers(bufs, dataclasses.replace(md, seq_lens=[built[0][0], 18]))  # valid: accepted
    before = {k: t.clone() for k, t in bufs.items()}
    with pytest.raises(ValueError, match=f"^{re.escape(error)}"):
        clone.prepare_graph_input_buffers(bufs, dataclasses.replace(md, **copied))
    assert all(torch.equal(bufs[k], before[k]) for k in before)

"""CUDA graphs: bucketing decisions, the TORCH_SDPA State, and CUDAGraphRunner.

CPU: the pure decisions (capture sizes, bucket, table width, eager reason), the SDPA State's
buffers and padding, and the runner's padded static-buffer step (`use_cuda_graphs=False`), which
runs the exact computation a graph would replay, across TORCH_SDPA's table widths too. GPU:
every available backend's graphs against eager on the reference model (teacher-forced), the
fallbacks, and memory over 1000+ replays.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference import flex_on_cpu, record_compiles, rel_err
from torch._inductor.compile_fx import compile_fx

import compiled_attn as ca
from compiled_attn.backends import flashinfer as fib
from compiled_attn.backends import torch_sdpa as sdpa_backend
from compiled_attn.backends.torch_sdpa import TorchSDPAState
from compiled_attn.graph_state import SCRATCH_BLOCK, table_widths
from compiled_attn.graphs import (
    DEFAULT_CAPTURE_SIZES,
    CUDAGraphRunner,
    capture_sizes_for,
    choose_path,
    pick_table_width,
)
from compiled_attn.graphs import compiler as compiler_module
from compiled_attn.graphs import pick_batch_size as pick
from compiled_attn.graphs import runner as runner_module
from compiled_attn.graphs.buckets import capture_widths_for, fill_padded, piecewise_sizes_for
from compiled_attn.graphs.compiler import COMPILE_OPTIONS, ONE_TOKEN_COMPILES, RunnerCompiler
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model
from compiled_attn.paging import BlockAllocator, Request, last_token_rows, schedule
from compiled_attn.testing.agreement import min_top1_agreement, near_tie

SDPA = "TORCH_SDPA"

# -------------------------------------------------------------------------------------------
# Pure decisions


def test_default_sizes_are_1_2_4_then_multiples_of_8_up_to_256():
    assert list(DEFAULT_CAPTURE_SIZES) == [1, 2, 4] + list(range(8, 257, 8))
    assert len(capture_sizes_for(256)) == 35


def test_capture_sizes_are_filtered_and_largest_first():
    assert capture_sizes_for(20) == [16, 8, 4, 2, 1]
    assert capture_sizes_for(3) == [2, 1]
    assert capture_sizes_for(10, [4, 1, 4, 12, 8]) == [8, 4, 1]


@pytest.mark.parametrize(("max_batch_size", "sizes"), [(0, None), (8, [0, 2]), (8, [2.0]), (1, [2, 4])])
def test_bad_capture_sizes_raise(max_batch_size, sizes):
    with pytest.raises(ValueError):
        capture_sizes_for(max_batch_size, sizes)


def test_numpy_ints_are_sizes_as_ints_are():
    assert capture_sizes_for(np.int64(8), list(np.array([1, 2, 4, 8]))) == [8, 4, 2, 1]
    assert piecewise_sizes_for(list(np.array([16, 64]))) == [64, 16]
    assert all(type(s) is int for s in capture_sizes_for(8, list(np.array([1, 2]))) + piecewise_sizes_for(
        list(np.array([16]))))


NOT_A_LIST = pytest.mark.parametrize("sizes", [8, {1, 2}], ids=["int", "set"])  # a set would lose its order


def not_a_list(sizes: object) -> str:
    return f"^capture sizes must be a list of ints, got {type(sizes).__name__}$"


@NOT_A_LIST
def test_capture_sizes_that_are_not_a_list_raise(sizes):
    with pytest.raises(ValueError, match=not_a_list(sizes)):
        capture_sizes_for(8, sizes)


@pytest.mark.parametrize(("num_seqs", "size"), [(1, 1), (2, 2), (3, 4), (8, 8), (13, 16), (250, 256), (257, None)])
def test_batch_goes_to_smallest_size_that_holds_it(num_seqs, size):
    assert pick(capture_sizes_for(256), num_seqs) == size


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 320))
def test_picked_size_is_the_minimum_that_fits(sizes, n):
    fits = [s for s in sizes if s >= n]
    assert pick(sizes, n) == (min(fits) if fits else None)


@pytest.mark.parametrize(
    ("num_prefills", "num_seqs", "max_seq_len", "path"),
    [
        (0, 3, 64, "graph"),  # max_seq_len == max_seq_len_to_capture still fits
        (1, 1, 10, "eager_prefill"),
        (2, 5, 30, "eager_prefill"),  # mixed
        (1, 40, 999, "eager_prefill"),  # prefill wins over the other reasons
        (0, 17, 10, "eager_oversize"),
        (0, 17, 999, "eager_oversize"),
        (0, 4, 65, "eager_overlong"),
    ],
)
def test_path_choice(num_prefills, num_seqs, max_seq_len, path):
    got = choose_path(num_prefills=num_prefills, num_seqs=num_seqs, max_seq_len=max_seq_len, largest_size=16,
                      max_seq_len_to_capture=64)
    assert got == path


def test_empty_batch_raises():
    with pytest.raises(ValueError, match="empty"):
        choose_path(num_prefills=0, num_seqs=0, max_seq_len=0, largest_size=8, max_seq_len_to_capture=64)


@pytest.mark.parametrize(("max_seq_len", "width"), [(1, 16), (256, 16), (257, 32), (512, 32), (513, 64),
                                                    (1024, 64), (1025, None)])
def test_step_goes_to_the_narrowest_width_that_holds_its_longest_sequence(max_seq_len, width):
    assert pick_table_width([64, 32, 16], max_seq_len, block_size=16) == width


@given(st.integers(1, 600), st.sampled_from([1, 3, 16, 64]), st.integers(1, 40_000))
def test_picked_width_holds_the_step_within_twice_its_need(max_blocks, block_size, max_seq_len):
    """TORCH_SDPA's widths: a step of need <= W blocks gets the narrowest width that holds it,
    at most twice its need or the 256-token floor."""
    widths = table_widths(max_blocks, block_size, TorchSDPAState.MIN_TABLE_WIDTH_TOKENS)
    need = -(-max_seq_len // block_size)
    width = pick_table_width(widths, max_seq_len, block_size)
    if need > max_blocks:
        assert width is None
        return
    assert width == min(w for w in widths if w >= need)
    assert width <= max(2 * need - 1, -(-256 // block_size), 1)


@given(st.lists(st.integers(1, 16), min_size=1, max_size=6), st.sampled_from([(0, 0, -1), (-1,), (7, -1)]))
def test_padded_inputs_hold_each_step_then_pads(counts, pads):
    """Steps of any sizes in a row: the buffers hold the step's ids, positions and slots, pads
    after them (zeros, -1 for slots, or any other pad; no buffer padded with zeros too), rows a
    larger earlier step wrote included, whatever they held before the first."""
    bufs = [torch.randint(1, 100, (16,), dtype=torch.int64) for _ in pads]
    pads_from = 16  # the first step finds garbage everywhere
    for n in counts:
        rows = [torch.randint(1, 100, (n,), dtype=torch.int64) for _ in pads]
        pads_from = fill_padded(bufs, rows, pads_from, pads)
        assert pads_from == n
        for buf, row, pad in zip(bufs, rows, pads, strict=True):
            assert torch.equal(buf, torch.cat([row, row.new_full((16 - n,), pad)]))


@pytest.mark.parametrize("widths", [(), (8, 16), (10, 0), (10, 11), (10, True), (10, 4.0)])
def test_a_state_declaring_bad_widths_is_refused(widths):
    with pytest.raises(ValueError, match="graph_table_widths"):
        capture_widths_for(widths, 10)


# -------------------------------------------------------------------------------------------
# TORCH_SDPA State on CPU

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 4, 128, 40


def cpu_spec(**kw) -> ca.AttentionSpec:
    kw = {"max_seq_len_to_capture": MAX_LEN, **kw}
    return TINY.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32, device="cpu", **kw)


def sdpa_builder(spec: ca.AttentionSpec):
    return ca.get_attn_backend(SDPA).get_builder_cls()(spec)


def decode_md(spec: ca.AttentionSpec, seq_lens: list[int], seed: int = 0):
    """Decode-only metadata with random distinct blocks per request."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(spec.num_blocks, generator=g).tolist()
    tables = []
    for s in seq_lens:
        need = -(-s // spec.block_size)
        tables.append(blocks[:need])
        blocks = blocks[need:]
    return sdpa_builder(spec).build(seq_lens, [1] * len(seq_lens), tables)


def captured(spec: ca.AttentionSpec, sizes: list[int]):
    """{bs: (md_bs, bufs, graph_state)} from the State API in docs/design.md's call order."""
    state = ca.get_attn_backend(SDPA).get_state_cls()(spec)
    out = {}
    with state.graph_capture(max(sizes)):
        for bs in sorted(sizes, reverse=True):
            md_bs = state.graph_capture_get_metadata_for_batch(bs)
            out[bs] = (md_bs, state.get_graph_input_buffers(md_bs), state.graph_clone(bs))
    return state, out


def test_static_buffers_have_the_pinned_shapes():
    spec = cpu_spec()
    _, graphs = captured(spec, [8, 2])
    bufs = graphs[8][1]
    width = -(-MAX_LEN // BLOCK_SIZE)
    expect = {
        "block_tables": (torch.int32, (8, width)),
        "seq_lens_tensor": (torch.int32, (8,)),
        "context_lens_tensor": (torch.int32, (8,)),
        "slot_mapping": (torch.int64, (8,)),
        "query_start_loc": (torch.int32, (9,)),
    }
    assert {k: (v.dtype, tuple(v.shape)) for k, v in bufs.items()} == expect


def test_metadata_for_batch_is_all_pads_over_the_static_buffers():
    _, graphs = captured(cpu_spec(), [8, 4])
    md_bs, bufs, _ = graphs[4]
    big = graphs[8][1]
    assert (md_bs.num_prefills, md_bs.num_prefill_tokens, md_bs.num_decode_tokens) == (0, 0, 4)
    assert md_bs.num_decodes == 4 and md_bs.backend_name == SDPA
    assert md_bs.slot_mapping.tolist() == [-1] * 4  # a warm-up on it writes nothing
    assert md_bs.seq_lens_tensor.tolist() == [1] * 4
    assert md_bs.block_tables.eq(0).all()
    assert md_bs.query_start_loc.tolist() == list(range(5))
    for name, t in bufs.items():  # views of the one set of buffers: the graph reads what prepare writes
        assert t.data_ptr() == big[name].data_ptr(), name


def test_prepare_copies_live_rows_and_pads_the_rest():
    spec = cpu_spec()
    _, graphs = captured(spec, [8])
    _, bufs, graph_state = graphs[8]
    graph_state.prepare_graph_input_buffers(bufs, decode_md(spec, [30, 7, 12, 22, 9, 5, 40, 3], seed=1))
    md = decode_md(spec, [13, 2, 37], seed=2)  # fewer, shorter: old rows must not survive
    graph_state.prepare_graph_input_buffers(bufs, md)
    graph_state.begin_forward(md)
    assert bufs["slot_mapping"].tolist() == md.slot_mapping.tolist() + [-1] * 5
    assert bufs["seq_lens_tensor"].tolist() == [13, 2, 37] + [1] * 5
    assert bufs["context_lens_tensor"].tolist() == [12, 1, 36] + [0] * 5
    assert bufs["query_start_loc"].tolist() == list(range(9))
    width = md.block_tables.shape[1]
    assert torch.equal(bufs["block_tables"][:3, :width], md.block_tables)
    assert bufs["block_tables"][3:].eq(0).all()


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "match"),
    [
        ([9], [9], "prefills"),
        ([9, 5], [3, 1], "prefills"),  # mixed
        ([5] * 5, [1] * 5, "do not fit"),
        ([MAX_LEN + 1], [1], "max_seq_len_to_capture"),
    ],
)
def test_prepare_rejects_steps_the_graph_cannot_serve(seq_lens, query_lens, match):
    spec = cpu_spec()
    _, graphs = captured(spec, [4])
    _, bufs, graph_state = graphs[4]
    tables = [list(range(i * 11, i * 11 + 11)) for i in range(len(seq_lens))]
    with pytest.raises(ValueError, match=match):
        graph_state.prepare_graph_input_buffers(bufs, sdpa_builder(spec).build(seq_lens, query_lens, tables))


def test_prepare_rejects_metadata_of_another_backend():
    spec = cpu_spec()
    _, graphs = captured(spec, [2])
    _, bufs, graph_state = graphs[2]
    md = decode_md(spec, [5])
    foreign = dataclasses.replace(md, backend_name="XFORMERS")
    with pytest.raises(ValueError, match="builder"):
        graph_state.prepare_graph_input_buffers(bufs, foreign)


def test_metadata_for_batch_outside_graph_capture_raises():
    state = ca.get_attn_backend(SDPA).get_state_cls()(cpu_spec())
    with pytest.raises(RuntimeError, match="graph_capture"):
        state.graph_capture_get_metadata_for_batch(1)


def test_metadata_for_batch_above_the_maximum_raises():
    state = ca.get_attn_backend(SDPA).get_state_cls()(cpu_spec())
    with state.graph_capture(4), pytest.raises(ValueError, match="outside 1..4"):
        state.graph_capture_get_metadata_for_batch(5)


def test_state_captures_decoder_attention_only():
    state = ca.get_attn_backend(SDPA).get_state_cls()(cpu_spec(attn_type=ca.AttentionType.ENCODER_ONLY))
    with pytest.raises(NotImplementedError, match="DECODER"), state.graph_capture(4):
        pass


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(TINY, seed=0, backend=SDPA)


def random_caches(spec: ca.AttentionSpec, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [c.normal_() for c in allocate_kv_caches(TINY, ca.get_attn_backend(SDPA), spec)]


def test_warm_up_on_pad_metadata_writes_nothing(tiny_model):
    spec = cpu_spec()
    _, graphs = captured(spec, [4])
    md_bs = graphs[4][0]
    caches = random_caches(spec, 0)
    before = [c.clone() for c in caches]
    ids = torch.randint(TINY.vocab_size, (4,))
    with ca.set_forward_context(md_bs):
        out = tiny_model(ids, torch.zeros(4, dtype=torch.int64), caches)
    assert torch.isfinite(out).all()
    for a, b in zip(caches, before, strict=True):
        assert torch.equal(a, b)


def test_step_over_prepared_buffers_matches_builder_metadata(tiny_model):
    spec = cpu_spec()
    _, graphs = captured(spec, [8])
    md_bs, bufs, graph_state = graphs[8]
    seq_lens = [13, 2, 37, 8, 21]
    md = decode_md(spec, seq_lens, seed=3)
    ids = torch.randint(TINY.vocab_size, (5,))
    pos = torch.tensor(seq_lens) - 1
    caches, padded_caches = random_caches(spec, 1), random_caches(spec, 1)
    with ca.set_forward_context(md):
        want = tiny_model(ids, pos, caches)
    graph_state.prepare_graph_input_buffers(bufs, md)
    pad = torch.zeros(3, dtype=torch.int64)
    with ca.set_forward_context(md_bs):
        got = tiny_model(torch.cat([ids, pad]), torch.cat([pos, pad]), padded_caches)
    torch.testing.assert_close(got[:5], want, rtol=1e-5, atol=1e-5)
    # the same slots written (up to the batch-size-dependent GEMM rounding of later layers), pads wrote nothing
    for a, b in zip(padded_caches, caches, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------
# Runner: the same padded static-buffer step without capture (CPU)


@dataclasses.dataclass
class Engine:
    """Serves named requests step by step through `call(md, ids, pos)`, with its own blocks."""

    spec: ca.AttentionSpec
    call: Callable[[ca.AttentionMetadata, torch.Tensor, torch.Tensor], torch.Tensor]
    backend_name: str = SDPA
    requests: dict[str, Request] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.allocator = BlockAllocator(self.spec.num_blocks, self.spec.block_size)
        self.builder = ca.get_attn_backend(self.backend_name).get_builder_cls()(self.spec)

    def step(self, batch: dict[str, list[int]]) -> torch.Tensor:
        """batch: name -> tokens to append before the step (the prompt for a new request).
        Prefills must come first. Returns next-token logits [len(batch), vocab]."""
        reqs = []
        for name, tokens in batch.items():
            r = self.requests.setdefault(name, Request(tokens=[]))
            r.tokens.extend(tokens)
            reqs.append(r)
        seq_lens, query_lens, tables, ids, pos = schedule(reqs, self.allocator, self.spec.device)
        md = self.builder.build(seq_lens, query_lens, tables)
        logits = self.call(md, ids, pos)[last_token_rows(query_lens)]
        for r in reqs:
            r.num_computed = len(r.tokens)
        return logits


def direct(model, caches):
    """The eager reference: the model under the step's own metadata."""
    def call(md, ids, pos):
        with ca.set_forward_context(md):
            return model(ids, pos, caches)
    return call


def prompts(n: int, seed: int, vocab: int, lo: int = 3, hi: int = 20) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{seed}.{i}": [rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for i in range(n)}


def static_runner(model, spec, caches, **kw) -> CUDAGraphRunner:
    runner = CUDAGraphRunner(model, ca.get_attn_backend(SDPA), spec, caches, use_cuda_graphs=False,
                             progress=False, **kw)
    runner.capture()
    return runner


def test_a_refused_graph_step_leaves_the_static_inputs_untouched(tiny_model):
    """A decode step the graphs refuse (metadata of another cache size) raises before the runner
    copies its ids and positions into the static buffers the graphs read."""
    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[2], max_batch_size=2)
    ids_before, pos_before = runner._input_ids.clone(), runner._positions.clone()
    other_spec = dataclasses.replace(spec, num_blocks=NUM_BLOCKS + 8)
    other = sdpa_builder(other_spec).build([5, 9], [1, 1], [[1, 2], [3, 4, 5]])
    ids, pos = torch.tensor([7, 8]), torch.tensor([4, 8])
    with pytest.raises(ValueError, match="num_blocks"):
        runner.run(other, ids, pos)
    assert torch.equal(runner._input_ids, ids_before) and torch.equal(runner._positions, pos_before)
    assert runner.counts["graph"] == 1  # the path was chosen; nothing was replayed or written


def test_runner_refuses_cuda_graphs_on_cpu(tiny_model):
    spec = cpu_spec()
    with pytest.raises(ValueError, match="CUDA"):
        CUDAGraphRunner(tiny_model, ca.get_attn_backend(SDPA), spec, random_caches(spec, 0))


def test_runner_refuses_a_spec_that_is_not_an_attention_spec(tiny_model):
    spec = cpu_spec()
    with pytest.raises(ValueError, match="^spec must be an AttentionSpec, got dict$"):
        CUDAGraphRunner(tiny_model, ca.get_attn_backend(SDPA), dataclasses.asdict(spec), random_caches(spec, 0),
                        use_cuda_graphs=False, progress=False)


def test_runner_refuses_a_backend_name_or_a_state_that_is_not_one(tiny_model):
    spec = cpu_spec()
    with pytest.raises(ValueError, match="^backend must be an AttentionBackend class, got 'TORCH_SDPA': pass "):
        CUDAGraphRunner(tiny_model, "TORCH_SDPA", spec, random_caches(spec, 0), use_cuda_graphs=False, progress=False)
    with pytest.raises(ValueError, match=r"^state must be an AttentionState \(backend.get_state_cls\(\)\(spec\)\) or "
                                         "None, got object$"):
        CUDAGraphRunner(tiny_model, ca.get_attn_backend(SDPA), spec, random_caches(spec, 0), object(),
                        use_cuda_graphs=False, progress=False)


@NOT_A_LIST
def test_runner_refuses_capture_sizes_that_are_not_a_list(tiny_model, sizes):
    spec = cpu_spec()
    with pytest.raises(ValueError, match=not_a_list(sizes)):
        CUDAGraphRunner(tiny_model, ca.get_attn_backend(SDPA), spec, random_caches(spec, 0), capture_sizes=sizes,
                        use_cuda_graphs=False, progress=False)


def test_capture_refuses_caches_on_another_device_and_captures_nothing(tiny_model):
    """A cache on another device than the spec's (meta stands in for another GPU) is refused
    at capture, before any graph is made: the runner stays uncaptured."""
    spec = cpu_spec()
    caches = random_caches(spec, 0)
    caches[1] = caches[1].to("meta")
    runner = CUDAGraphRunner(tiny_model, ca.get_attn_backend(SDPA), spec, caches, capture_sizes=[1],
                             use_cuda_graphs=False, progress=False)
    with pytest.raises(ValueError, match=r"^kv_caches\[1\] is on meta, the spec's device is cpu$"):
        runner.capture()
    assert not runner.capture_stats
    with pytest.raises(RuntimeError, match=r"call runner.capture\(\) before runner.run\(\)"):
        runner.run(decode_md(spec, [5]), torch.tensor([3]), torch.tensor([4]))


def test_run_before_capture_raises(tiny_model):
    spec = cpu_spec()
    runner = CUDAGraphRunner(tiny_model, ca.get_attn_backend(SDPA), spec, random_caches(spec, 0),
                             use_cuda_graphs=False)
    with pytest.raises(RuntimeError, match=r"^call runner.capture\(\) before runner.run\(\)$"):
        runner.run(decode_md(spec, [5]), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


def test_capture_stats_name_the_sizes(tiny_model):
    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[4, 1, 2], max_batch_size=3)
    stats = runner.capture_stats
    assert (stats["num_graphs"], stats["sizes"]) == (2, [2, 1])
    assert stats["table_widths"] == [-(-MAX_LEN // BLOCK_SIZE)]  # 40 tokens: below the 256-token floor
    assert stats["pool_bytes"] is None  # no graphs, no pool


def test_capture_twice_raises(tiny_model):
    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1, 2])
    with pytest.raises(RuntimeError, match="captured already"):
        runner.capture()


@pytest.mark.parametrize("batch", [1, 3, 8, 5])
def test_padded_static_decode_matches_eager(tiny_model, batch):
    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1, 2, 4, 8], max_batch_size=8)
    ref = Engine(spec, direct(tiny_model, random_caches(spec, 1)))
    eng = Engine(spec, runner.run)
    batch_prompts = prompts(batch, seed=batch, vocab=TINY.vocab_size)
    step = dict(batch_prompts)
    for _ in range(8):
        want = ref.step(step)
        got = eng.step(step)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        step = {name: [tok] for name, tok in zip(step, want.argmax(-1).tolist(), strict=True)}
    assert runner.counts == {"graph": 7, "piecewise": 0, "eager_prefill": 1, "eager_oversize": 0, "eager_overlong": 0}


def test_pad_tokens_are_zeros_after_a_smaller_step_follows_a_larger_one():
    spec = cpu_spec()
    seen = []

    def model(input_ids, positions, kv_caches):
        seen.append((input_ids.tolist(), positions.tolist()))
        return torch.zeros(input_ids.shape[0], 1)

    runner = static_runner(model, spec, random_caches(spec, 0), capture_sizes=[8], max_batch_size=8)
    for n in (6, 6, 2, 5):
        seq_lens = [10 + i for i in range(n)]
        tokens = torch.arange(1, n + 1)
        runner.run(decode_md(spec, seq_lens), tokens, torch.tensor(seq_lens) - 1)
        assert seen[-1] == ([*range(1, n + 1)] + [0] * (8 - n), [s - 1 for s in seq_lens] + [0] * (8 - n)), n


def test_fallbacks_run_eagerly_and_match(tiny_model):
    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1, 2, 4], max_batch_size=4)
    ref, eng = Engine(spec, direct(tiny_model, random_caches(spec, 1))), Engine(spec, runner.run)
    a = prompts(6, seed=0, vocab=TINY.vocab_size)
    long = {"long": list(range(MAX_LEN))}  # its first decode has seq_len MAX_LEN + 1
    steps = [
        {k: a[k] for k in list(a)[:3]},  # prefill
        {**{k: a[k] for k in list(a)[3:]}, **{k: [1] for k in list(a)[:3]}},  # mixed
        {k: [2] for k in a},  # 6 decodes > 4: oversize
        long,
        {**{k: [3] for k in list(a)[:2]}, "long": [4]},  # overlong
        {k: [5] for k in list(a)[:3]},  # graph again
    ]
    for batch in steps:
        torch.testing.assert_close(eng.step(batch), ref.step(batch), rtol=1e-4, atol=1e-4)
    assert runner.counts == {"graph": 1, "piecewise": 0, "eager_prefill": 3, "eager_oversize": 1, "eager_overlong": 1}


@pytest.mark.parametrize("runner_compiles", [False, True])
@pytest.mark.parametrize("first_call", ["graph decode", "eager prefill"])
def test_runner_traces_the_models_floats_as_constants(tiny_model, monkeypatch, runner_compiles, first_call):
    """Under dynamic=True Dynamo lifts each RMSNorm's eps into a float64 CPU input (Inductor's C++
    kernel and a host-to-device copy every step). The runner traces without them wherever its
    first call into the model is, a graph step's static buffers or an eager step, for a caller's
    compiled model and for its own compile."""
    spec = cpu_spec()
    torch._dynamo.reset()
    recorder = record_compiles(monkeypatch)  # the runner's own torch.compile or the caller's
    model = tiny_model if runner_compiles else torch.compile(tiny_model, fullgraph=True, dynamic=True)
    caches = random_caches(spec, 0)
    runner = static_runner(model, spec, caches, capture_sizes=[1, 4], max_batch_size=4, compile=runner_compiles)
    first = prompts(3, seed=5, vocab=TINY.vocab_size)
    if first_call == "graph decode":  # the prompts eagerly outside the runner, then 3 decodes through it
        eng = Engine(spec, direct(tiny_model, caches))
        eng.step(first)
        eng.call = runner.run
        eng.step({name: [1] for name in first})
        assert runner.counts["graph"] == 1
    else:
        Engine(spec, runner.run).step(first)
        assert runner.counts["eager_prefill"] == 1
    assert len(recorder.graphs) == 1  # traced by that first call
    # the inputs are the ids, positions, caches and weights (float32 on this CPU model); unpatched,
    # the graph also holds one float64 per norm
    assert (torch.float64, "cpu") not in recorder.graphs[0], recorder.graphs[0]
    torch._dynamo.reset()


def test_floats_as_constants_restores_dynamos_setting_however_the_block_ends():
    with torch._dynamo.config.patch(specialize_float=False):
        with ca.floats_as_constants():
            assert torch._dynamo.config.specialize_float is True
        assert torch._dynamo.config.specialize_float is False
        with pytest.raises(RuntimeError, match="traced"), ca.floats_as_constants():
            raise RuntimeError("traced")
        assert torch._dynamo.config.specialize_float is False


def test_result_belongs_to_the_caller(tiny_model):
    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[2], max_batch_size=2)
    md = decode_md(spec, [6, 9])
    ids, pos = torch.tensor([3, 4]), torch.tensor([5, 8])
    first = runner.run(md, ids, pos)
    kept = first.clone()
    runner.run(decode_md(spec, [7, 3], seed=1), torch.tensor([9, 1]), torch.tensor([6, 2]))
    assert torch.equal(first, kept)


def test_replay_on_reallocated_caches_raises(tiny_model):
    spec = cpu_spec()
    caches = random_caches(spec, 0)
    runner = static_runner(tiny_model, spec, caches, capture_sizes=[1])
    md, ids, pos = decode_md(spec, [5]), torch.tensor([3]), torch.tensor([4])
    with pytest.raises(RuntimeError, match="captured with"):
        runner.run(md, ids, pos, kv_caches=[c.clone() for c in caches])
    caches[1] = caches[1].clone()  # the runner's own list, one layer replaced
    with pytest.raises(RuntimeError, match="captured with"):
        runner.run(md, ids, pos)


def test_replay_on_caches_that_are_not_a_list_of_tensors_names_the_type(tiny_model):
    """The graph path checks the list by mapping data_ptr over it: what is not a list of tensors
    gets the same error as on every other path, not an address mismatch."""
    spec = cpu_spec()
    caches = random_caches(spec, 0)
    runner = static_runner(tiny_model, spec, caches, capture_sizes=[1])
    md, ids, pos = decode_md(spec, [5]), torch.tensor([3]), torch.tensor([4])
    for bad in (caches[0], [caches[0], "cache"], [None] * len(caches)):
        with pytest.raises(ValueError, match="kv_caches must be a list of cache tensors"):
            runner.run(md, ids, pos, kv_caches=bad)
    assert runner.counts["graph"] == 3


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (torch.tensor([3], dtype=torch.int32), "int64"),
        (torch.tensor([3], device="meta"), "int64"),  # another device
        (torch.tensor([3, 4]), "describes 1"),
    ],
)
def test_bad_inputs_raise(tiny_model, ids, match):
    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1])
    with pytest.raises(ValueError, match=match):
        runner.run(decode_md(spec, [5]), ids, torch.tensor([4]))


@pytest.mark.parametrize("label", ["input_ids", "positions"])
def test_inputs_that_are_not_tensors_raise_and_write_nothing(tiny_model, label):
    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1])
    ids_before, pos_before = runner._input_ids.clone(), runner._positions.clone()
    args = {"input_ids": torch.tensor([3]), "positions": torch.tensor([4]), label: [3]}
    with pytest.raises(ValueError, match=rf"^{label} must be a torch.int64 tensor \[num_tokens\], got list$"):
        runner.run(decode_md(spec, [5]), **args)
    assert torch.equal(runner._input_ids, ids_before) and torch.equal(runner._positions, pos_before)
    assert not any(runner.counts.values()), "refused before a path was chosen"


def test_metadata_of_another_backend_raises(tiny_model):
    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1])
    foreign = dataclasses.replace(decode_md(spec, [5]), backend_name="FLASHINFER")
    with pytest.raises(ValueError, match="TORCH_SDPA metadata"):
        runner.run(foreign, torch.tensor([3]), torch.tensor([4]))


def test_runner_compiles_batch_one_apart_and_samples_in_the_step(tiny_model):
    """compile=True: a static graph for batch 1 and one graph for every other size (and the
    eager steps); `postprocess` runs inside the step, so run() returns the greedy tokens. An
    eager one-token step (a one-token prompt) reuses batch 1's graph: no trace of its own."""
    spec = cpu_spec()
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1, 2, 4], max_batch_size=4,
                           compile=True, postprocess=lambda logits: logits.argmax(-1))
    ref, eng = Engine(spec, direct(tiny_model, random_caches(spec, 1))), Engine(spec, runner.run)
    step = prompts(3, seed=11, vocab=TINY.vocab_size)
    for i in range(5):  # a prefill, decodes of 3, then of 1 (the other requests stop)
        want = ref.step(step).argmax(-1)
        assert torch.equal(eng.step(step), want), f"step {i}"
        step = {name: [tok] for name, tok in zip(step, want.tolist(), strict=True)}
        if i == 2:
            step = dict(list(step.items())[:1])
    assert runner.counts["graph"] == 4 and runner.counts["eager_prefill"] == 1
    solo = {"solo": [7]}
    assert torch.equal(eng.step(solo), ref.step(solo).argmax(-1))
    assert runner.counts["eager_prefill"] == 2
    # one graph for the prefill and batch 4, one for batch 1 and the one-token prompt
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2


class RecordingInductor:
    """Inductor's `compile_fx` in place of the one `graphs/compiler.py` calls, recording: each
    compile is tagged with the ONE_TOKEN_COMPILES name of its options ("shared" outside the
    `compiler`'s one_token_calls) and listed in `compiles` with its graph's input sources and
    parameters' sources; each call of a compiled graph appends its tag to `ran`."""

    def __init__(self, monkeypatch) -> None:
        self.compiler: RunnerCompiler | None = None  # set before the first compile
        self.compiles, self.ran = [], []
        monkeypatch.setattr(compiler_module, "compile_fx", self)

    def __call__(self, gm, example_inputs, config_patches):
        name = "shared" if not self.compiler._tracing_one_token else next(
            n for n, options in ONE_TOKEN_COMPILES.items() if options is config_patches)
        sources = [node._dynamo_source for node in gm.graph.find_nodes(op="placeholder")]
        self.compiles.append((name, config_patches, sources, gm._param_name_to_source))
        fn = compile_fx(gm, example_inputs, config_patches=config_patches)

        def run(*args):
            self.ran.append(name)
            return fn(*args)

        return run


def test_batch_one_keeps_the_compile_whose_graph_replays_fastest(tiny_model, monkeypatch):
    """The pick of batch 1's compile: the one whose graph replays fastest in three alternating rounds
    (on CPU with stand-in graphs and timings). Without graphs there is no pick."""

    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1, 2], max_batch_size=2,
                           compile=True)
    assert runner.capture_stats["one_token"] is None and not runner._pick_batch_one
    rounds = {"reductions": iter([5.0, 4.0, 4.5]), "cublas": iter([4.2, 3.9, 4.4])}
    order = []

    def replay_ms(graph, replays):
        order.append(graph)
        assert replays == runner_module.ONE_TOKEN_TIMED_REPLAYS
        return next(rounds[graph])

    monkeypatch.setattr(runner_module, "_replay_ms", replay_ms)
    assert runner._pick_one_token({"reductions": "reductions", "cublas": "cublas"}) == "cublas"
    assert order == ["reductions", "cublas"] * 3
    assert runner._one_token_stats == {"compile": "cublas", "replay_ms": {"reductions": 4.0, "cublas": 3.9}}
    torch._dynamo.reset()


def test_batch_one_pick_of_a_sharded_model_follows_the_slowest_rank(tiny_model, monkeypatch):
    """With a group (a sharded model's capture), the pick goes by `slowest_rank_ms` of this rank's
    best replays: here the other rank is slow on cublas, so reductions is kept though cublas
    replayed faster on this rank; the stats hold both."""
    from compiled_attn.graphs import runner as runner_module

    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1], max_batch_size=1)
    group, seen = object(), []

    def slowest_rank_ms(replay_ms, got_group):
        seen.append((dict(replay_ms), got_group))
        return {"reductions": replay_ms["reductions"], "cublas": 9.0}

    monkeypatch.setattr(runner_module, "_replay_ms", lambda graph, replays: {"reductions": 4.0, "cublas": 3.0}[graph])
    monkeypatch.setattr(runner_module, "slowest_rank_ms", slowest_rank_ms)
    runner._group = group
    assert runner._pick_one_token({"reductions": "reductions", "cublas": "cublas"}) == "reductions"
    assert seen == [({"reductions": 4.0, "cublas": 3.0}, group)]
    assert runner._one_token_stats == {"compile": "reductions", "replay_ms": {"reductions": 4.0, "cublas": 3.0},
                                       "slowest_rank_ms": {"reductions": 4.0, "cublas": 9.0}}


def test_batch_one_graphs_of_every_width_are_the_kept_compiles(tiny_model, monkeypatch):
    """The capture's wiring of the pick, on CPU with stand-in graphs: batch 1's widest graph is
    captured once per compile, its calls marked as one token's (their trace compiles them all);
    the faster's graph is the one kept for that size and width, the narrower widths of batch 1 are
    captured from the kept compile only, and every later one-token call runs it. A batch-1 graph
    compiled before the capture (no compiles to compare) fails the capture; with Dynamo compiling
    nothing (disabled) batch 1 is captured once, with no pick."""
    from compiled_attn.graphs import runner as runner_module

    spec = wide_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1, 2], max_batch_size=2)
    assert runner.widths == [64, 32, 16]
    runner._compiler, runner._pick_batch_one = RunnerCompiler(), True
    captured = []

    def capture_graph(self, bs, md_bs, input_buffers, graph_state, pool, side_stream):
        if self._output is None:
            self._output = torch.empty(bs, TINY.vocab_size)
        with self._one_token_calls(bs):  # as `_static_step` calls the model
            one_token = self._compiler._tracing_one_token
        if one_token and trace_batch_one:
            self._compiler.one_token_graphs = 1  # Dynamo's trace of batch 1, compiled per option set
        graph = (bs, md_bs.block_tables.shape[1], self._compiler.use if bs == 1 else "-")
        captured.append((*graph, one_token))
        return graph, True

    monkeypatch.setattr(CUDAGraphRunner, "_capture_graph", capture_graph)
    monkeypatch.setattr(runner_module, "_replay_ms", lambda graph, replays: 2.0 if graph[2] == "reductions" else 3.0)
    trace_batch_one = False  # batch 1's calls trace nothing
    with runner.state.graph_capture(2):  # Dynamo compiles nothing (disabled): one graph, no pick
        assert runner._capture_size(1, 64, None, "a side stream").graph == (1, 64, "reductions")
    assert captured == [(1, 64, "reductions", True)] and runner._one_token_stats is None
    runner._compiler.compiles = 1  # Dynamo compiled batch 1 before the capture
    with runner.state.graph_capture(2), pytest.raises(RuntimeError, match="compiled before the capture"):
        runner._capture_size(1, 64, None, "a side stream")
    assert len(captured) == 2 and runner._compiler.kept is None  # failed after the first compile's capture
    trace_batch_one, captured = True, []
    with runner.state.graph_capture(2):
        entries = {(bs, w): runner._capture_size(bs, w, None, "a side stream") for bs in (2, 1) for w in runner.widths}
    assert captured == [(2, 64, "-", False), (2, 32, "-", False), (2, 16, "-", False),
                        (1, 64, "reductions", True), (1, 64, "cublas", True),
                        (1, 32, "reductions", True), (1, 16, "reductions", True)]
    assert {key: entry.graph for key, entry in entries.items()} == {
        (2, 64): (2, 64, "-"), (2, 32): (2, 32, "-"), (2, 16): (2, 16, "-"),
        (1, 64): (1, 64, "reductions"), (1, 32): (1, 32, "reductions"), (1, 16): (1, 16, "reductions")}
    assert all(entry.prepare_kw == {"upload": False} for entry in entries.values())
    assert runner._one_token_stats == {"compile": "reductions", "replay_ms": {"reductions": 2.0, "cublas": 3.0}}
    assert runner._compiler.use == runner._compiler.kept == "reductions"


def test_runner_compiler_compiles_batch_one_per_option_set_from_one_trace(monkeypatch):
    """RunnerCompiler on CPU with Inductor: a graph traced outside `one_token_calls` is compiled once
    with COMPILE_OPTIONS; one traced inside it is traced once and compiled once per
    ONE_TOKEN_COMPILES entry (each from a graph with Dynamo's input sources, each keeping the
    graph's in-place write), and each call runs the compile `use` names; once a compile is kept,
    batch 1 traced again (another grad mode) is compiled with the kept options alone. Every output
    against a float64 reference."""
    inductor = RecordingInductor(monkeypatch)
    compiles, ran = inductor.compiles, inductor.ran
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(32, 16, generator=gen), torch.randn(32, generator=gen)

    def step(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(x.sum(0))  # an in-place write, as the cache write op's
        return torch.nn.functional.linear(x, weight, bias).relu().sum(-1)

    def reference(x: torch.Tensor) -> torch.Tensor:
        return (x.double() @ weight.double().T + bias.double()).relu().sum(-1)

    torch._dynamo.reset()
    backend = inductor.compiler = RunnerCompiler()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    cache = torch.randn(16, generator=gen)
    want_cache = cache.double()
    for x, use in [(torch.randn(3, 16, generator=gen), None), (torch.randn(1, 16, generator=gen), "cublas"),
                   (torch.randn(1, 16, generator=gen), "reductions")]:
        want_cache += x.double().sum(0)
        if use is None:  # three rows: the shared graph, one compile
            torch.testing.assert_close(compiled(x, cache).double(), reference(x), rtol=1e-5, atol=1e-5)
            assert [c[:2] for c in compiles] == [("shared", COMPILE_OPTIONS)] and backend.one_token_graphs == 0
            continue
        backend.use = use
        with backend.one_token_calls():  # the first row of one traces once; the second reuses it
            torch.testing.assert_close(compiled(x, cache).double(), reference(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.double(), want_cache)
    assert [c[:2] for c in compiles] == [("shared", COMPILE_OPTIONS), *ONE_TOKEN_COMPILES.items()]
    assert backend.one_token_graphs == 1
    (_, _, shared_sources, _), *candidates = compiles
    assert all(source is not None for source in shared_sources)
    assert [c[2:] for c in candidates] == [candidates[-1][2:]] * len(candidates)  # the copies keep the sources
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2
    assert ran == ["shared", "cublas", "reductions"]

    backend.keep("cublas")
    one = torch.randn(1, 16, generator=gen)
    with torch.no_grad(), backend.one_token_calls():  # grad mode is guarded: batch 1 traced again
        torch.testing.assert_close(compiled(one, cache).double(), reference(one), rtol=1e-5, atol=1e-5)
    assert [c[:2] for c in compiles[3:]] == [("cublas", ONE_TOKEN_COMPILES["cublas"])]
    assert ran[3:] == ["cublas"] and backend.one_token_graphs == 1
    torch._dynamo.reset()


class FailingCandidate(RecordingInductor):
    """RecordingInductor whose compile with `failing`'s ONE_TOKEN_COMPILES options raises."""

    def __init__(self, monkeypatch, failing: str) -> None:
        super().__init__(monkeypatch)
        self.failing = failing

    def __call__(self, gm, example_inputs, config_patches):
        if self.compiler._tracing_one_token and config_patches is ONE_TOKEN_COMPILES[self.failing]:
            raise RuntimeError(f"{self.failing} lowering broke")
        return super().__call__(gm, example_inputs, config_patches)


def test_batch_one_goes_without_a_candidate_that_fails_to_compile(monkeypatch):
    """A batch-1 candidate compile that raises (cuBLAS's GEMVs here) is left out with a warning that
    names it and its error, recorded in `failed`; the primary compile serves batch 1 and its output
    matches a float64 reference. If the primary itself fails, the compile fails."""
    inductor = FailingCandidate(monkeypatch, failing="cublas")
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(8, 16, generator=gen)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight).tanh()

    torch._dynamo.reset()
    backend = inductor.compiler = RunnerCompiler()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    x = torch.randn(1, 16, generator=gen)
    with backend.one_token_calls(), pytest.warns(UserWarning, match="batch 1's 'cublas' compile .* failed.*"
                                                 "RuntimeError: cublas lowering broke"):
        out = compiled(x)
    torch.testing.assert_close(out.double(), (x.double() @ weight.double().T).tanh(), rtol=1e-5, atol=1e-5)
    assert backend.failed == {"cublas": "RuntimeError: cublas lowering broke"}
    assert [c[0] for c in inductor.compiles] == ["reductions"] and inductor.ran == ["reductions"]
    assert backend.use == compiler_module.PRIMARY_ONE_TOKEN_COMPILE == "reductions"

    torch._dynamo.reset()
    inductor = FailingCandidate(monkeypatch, failing="reductions")
    backend = inductor.compiler = RunnerCompiler()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    with backend.one_token_calls(), pytest.raises(Exception, match="reductions lowering broke"):
        compiled(x)
    assert backend.failed == {} and inductor.compiles == []
    torch._dynamo.reset()


def test_batch_one_capture_skips_a_candidate_that_failed_to_compile(tiny_model, monkeypatch):
    """The capture's pick on CPU with stand-in graphs, the cuBLAS candidate having failed to compile
    in batch 1's trace: batch 1 is captured once, from the primary compile, which is kept; the
    capture's stats name the failure."""
    from compiled_attn.graphs import runner as runner_module

    spec = cpu_spec()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1], max_batch_size=1)
    runner._compiler, runner._pick_batch_one = RunnerCompiler(), True
    captured = []

    def capture_graph(self, bs, md_bs, input_buffers, graph_state, pool, side_stream):
        if self._output is None:
            self._output = torch.empty(bs, TINY.vocab_size)
        if not self._compiler.one_token_graphs:  # the first call traces batch 1: the candidate fails
            self._compiler.one_token_graphs, self._compiler.failed["cublas"] = 1, "RuntimeError: broke"
        captured.append(self._compiler.use)
        return self._compiler.use, True

    monkeypatch.setattr(CUDAGraphRunner, "_capture_graph", capture_graph)
    monkeypatch.setattr(runner_module, "_replay_ms", lambda graph, replays: 2.5)
    with runner.state.graph_capture(1):
        entry = runner._capture_size(1, runner.widths[0], None, "a side stream")
    assert captured == ["reductions"] and entry.graph == "reductions"
    assert runner._one_token_stats == {"compile": "reductions", "replay_ms": {"reductions": 2.5},
                                       "failed": {"cublas": "RuntimeError: broke"}}
    assert runner._compiler.use == runner._compiler.kept == "reductions"


def test_one_token_calls_nest_and_stay_in_their_thread():
    """The mark of one-token calls is a context variable: a nested call leaves it on for the rest of
    the outer one, and a trace on another thread meanwhile is not batch 1's."""
    compiler, seen = RunnerCompiler(), []
    with compiler.one_token_calls():
        with compiler.one_token_calls():
            pass
        seen.append(compiler._tracing_one_token)
        other = threading.Thread(target=lambda: seen.append(compiler._tracing_one_token))
        other.start()
        other.join()
    seen.append(compiler._tracing_one_token)
    assert seen == [True, False, False]


def test_one_token_eager_steps_run_the_kept_compile(tiny_model, monkeypatch):
    """The runner's one-token calls through the real backend on CPU (Inductor): batch 1's static step,
    called once per compile as the capture's pick does, traces once and compiles twice; after `keep`,
    a one-token prompt served under `no_grad` (a grad mode the capture did not trace: batch 1 traced
    again) runs the kept compile and gives the reference's greedy token; a prefill of three runs the
    shared graph."""
    inductor = RecordingInductor(monkeypatch)
    ran = inductor.ran
    spec = cpu_spec()
    torch._dynamo.reset()
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1], max_batch_size=1,
                           compile=True, postprocess=lambda logits: logits.argmax(-1))
    runner._pick_batch_one, inductor.compiler = True, runner._compiler  # as with CUDA graphs (their timing aside)
    with runner.state.graph_capture(1), ca.set_forward_context(runner.state.graph_capture_get_metadata_for_batch(1)):
        for name in ONE_TOKEN_COMPILES:
            runner._compiler.use = name
            runner._static_step(1)
    runner._compiler.keep("cublas")
    assert ran == list(ONE_TOKEN_COMPILES) and runner._compiler.one_token_graphs == 1
    ran.clear()
    ref, eng = Engine(spec, direct(tiny_model, random_caches(spec, 1))), Engine(spec, runner.run)
    with torch.no_grad():
        assert torch.equal(eng.step({"solo": [7]}), ref.step({"solo": [7]}).argmax(-1))
    three = prompts(3, seed=2, vocab=TINY.vocab_size)
    assert torch.equal(eng.step(three), ref.step(three).argmax(-1))
    assert ran == ["cublas", "shared"] and runner.counts["eager_prefill"] == 2
    assert runner._compiler.one_token_graphs == 1  # the second batch-1 trace: the kept compile alone
    torch._dynamo.reset()


def test_runner_on_flex_graph_decode_serves_greedy_tokens_like_eager(tiny_model, monkeypatch):
    """TORCH_SDPA's FlexAttention decode (CUDA's default) through the runner's static steps: the same
    greedy tokens as the eager model (which gathers), prefill and decodes of 3 then 1 requests."""
    monkeypatch.setenv(sdpa_backend.GRAPH_DECODE_ENV, "flex")
    monkeypatch.setattr(sdpa_backend, "FLEX_DEVICES", ("cuda", "cpu"))
    flex_on_cpu(monkeypatch)
    spec = TINY.attention_spec(block_size=16, num_blocks=48, dtype=torch.float32, device="cpu",
                               max_seq_len_to_capture=MAX_LEN)
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[4], max_batch_size=4)
    assert runner.state.decode_kernel == "flex" and runner.widths == [runner.state.max_blocks_per_seq]
    ref, eng = Engine(spec, direct(tiny_model, random_caches(spec, 1))), Engine(spec, runner.run)
    step = prompts(3, seed=12, vocab=TINY.vocab_size)
    for i in range(5):
        want = ref.step(step).argmax(-1)
        assert torch.equal(eng.step(step).argmax(-1), want), f"step {i}"
        step = {name: [tok] for name, tok in zip(step, want.tolist(), strict=True)}
        if i == 2:
            step = dict(list(step.items())[:1])
    assert runner.counts["graph"] == 4 and runner.counts["eager_prefill"] == 1


# -------------------------------------------------------------------------------------------
# Runner over TORCH_SDPA's table widths (CPU)

WIDE_BLOCK_SIZE, WIDE_MAX_LEN = 16, 1024  # TORCH_SDPA's widths: 64, 32 and 16 blocks (1024, 512, 256 tokens)


def wide_spec() -> ca.AttentionSpec:
    return TINY.attention_spec(block_size=WIDE_BLOCK_SIZE, num_blocks=256, dtype=torch.float32, device="cpu",
                               max_seq_len_to_capture=WIDE_MAX_LEN)


class RecordingStep:
    """The model, recording the block table of the metadata each step runs under (a graph's view
    on the static path, the builder's table on the eager one)."""

    def __init__(self, model) -> None:
        self.model, self.tables = model, []

    def __call__(self, input_ids, positions, kv_caches):
        self.tables.append(ca.get_forward_context().attn_metadata.block_tables.clone())
        return self.model(input_ids, positions, kv_caches)


def nan_caches(spec: ca.AttentionSpec) -> list[torch.Tensor]:
    """Caches whose every slot is NaN until written: a read of a slot no request wrote shows."""
    return [c.fill_(float("nan")) for c in allocate_kv_caches(TINY, ca.get_attn_backend(SDPA), spec)]


def test_runner_captures_every_width_per_size_and_replays_the_narrowest_that_holds_the_step(tiny_model):
    """Mixed live lengths whose longest crosses 256 and 512 tokens, up to max_seq_len_to_capture:
    each graph step runs under the view of the smallest size >= n and the narrowest width >= its
    longest need, computes what eager does, and pads and columns past a row's need write nothing
    (the caches, NaN wherever unwritten, end equal) and name only valid blocks."""
    spec = wide_spec()
    step_model = RecordingStep(tiny_model)
    caches, ref_caches = nan_caches(spec), nan_caches(spec)
    runner = static_runner(step_model, spec, caches, capture_sizes=[1, 4], max_batch_size=4)
    assert runner.capture_stats["table_widths"] == [64, 32, 16] and runner.capture_stats["num_graphs"] == 6
    ref, eng = Engine(spec, direct(tiny_model, ref_caches)), Engine(spec, runner.run)
    rng = random.Random(0)
    lens = {"a": 250, "b": 5, "c": 505, "d": WIDE_MAX_LEN - 3}
    toks = {name: [rng.randrange(TINY.vocab_size) for _ in range(n)] for name, n in lens.items()}
    plan = [({"a": 0, "b": 0}, 1), (("a", "b"), 8),  # a: 251..258 tokens, crossing 256
            ({"c": 0}, 1), (("a", "b", "c"), 9),  # c: 506..514, crossing 512
            ({"d": 0}, 1), (("b", "d"), 4),  # d: 1022..1024 (the full width), then 1025: overlong; c's row a pad
            (("b",), 2)]  # one short row again, after wider steps in the same buffers
    seen = checked = 0
    for batch, repeat in plan:
        for _ in range(repeat):
            step = {n: toks[n] for n in batch} if isinstance(batch, dict) else {n: [toks[n][-1]] for n in batch}
            want, got = ref.step(step), eng.step(step)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            table = step_model.tables[seen]
            seen = len(step_model.tables)
            for name, tok in zip(step, want.argmax(-1).tolist(), strict=True):
                toks[name].append(tok)
            longest = max(len(eng.requests[n].tokens) for n in step)
            if isinstance(batch, dict) or longest > WIDE_MAX_LEN:
                continue  # prefill, or overlong: eager, under the builder's own table
            n, bs = len(step), pick([1, 4], len(step))
            width = min(w for w in (16, 32, 64) if w * WIDE_BLOCK_SIZE >= longest)
            assert table.shape == (bs, width), (list(step), longest)
            assert table[n:].eq(SCRATCH_BLOCK).all(), "pad rows read the scratch block"
            assert ((table >= 0) & (table < spec.num_blocks)).all(), "every column names a block of the cache"
            checked += 1
    assert checked == runner.counts["graph"]
    assert runner.counts == {"graph": 8 + 9 + 3 + 2, "piecewise": 0, "eager_prefill": 3, "eager_oversize": 0,
                             "eager_overlong": 1}
    for got_cache, want_cache in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-5, equal_nan=True)


class NarrowSDPAState(TorchSDPAState):
    """TORCH_SDPA's State with an 8-token floor: widths 10, 8, 4 and 2 blocks of 4 at MAX_LEN 40."""

    MIN_TABLE_WIDTH_TOKENS = 8


def test_table_widths_compile_no_more_graphs(tiny_model):
    """The metadata of another width reaches the ops through the forward context, never as a
    model input: runner(compile=True) still makes one graph for batch 1 and one for the rest."""
    spec = cpu_spec()
    state = NarrowSDPAState(spec)
    assert state.graph_table_widths() == (10, 8, 4, 2)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runner = CUDAGraphRunner(tiny_model, ca.get_attn_backend(SDPA), spec, random_caches(spec, 0), state,
                             capture_sizes=[1, 2, 4], max_batch_size=4, use_cuda_graphs=False, progress=False,
                             compile=True, postprocess=lambda logits: logits.argmax(-1))
    runner.capture()
    ref, eng = Engine(spec, direct(tiny_model, random_caches(spec, 1))), Engine(spec, runner.run)
    step = prompts(3, seed=12, vocab=TINY.vocab_size, lo=3, hi=6)
    widths = set()
    for i in range(20):  # a prefill, then decodes from <= 8 tokens to > 16: widths 2, 4 and 8
        want = ref.step(step).argmax(-1)
        assert torch.equal(eng.step(step), want), f"step {i}"
        if i:
            longest = max(len(eng.requests[name].tokens) for name in step)
            widths.add(pick_table_width(runner.widths, longest, BLOCK_SIZE))
        step = {name: [tok] for name, tok in zip(step, want.tolist(), strict=True)}
        if i == 14:
            step = dict(list(step.items())[:1])
    assert widths >= {2, 4, 8}
    assert runner.counts["graph"] == 19 and runner.counts["eager_prefill"] == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2


# -------------------------------------------------------------------------------------------
# GPU: real graphs, every available backend

GPU_CONFIG = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                         num_kv_heads=2)  # head_size 64: every backend's kernels take it
GPU_MAX_LEN = 128
GPU_SIZES = [1, 2, 4, 8, 16]
DECODE_STEPS = 32


@dataclasses.dataclass
class GpuSetup:
    name: str
    backend: type[ca.AttentionBackend]
    spec: ca.AttentionSpec
    model: torch.nn.Module
    runner: CUDAGraphRunner
    ref_caches: list[torch.Tensor]

    def engines(self) -> tuple[Engine, Engine]:
        """(eager reference, graph runner), each serving its own copy of the requests."""
        ref = Engine(self.spec, direct(self.model, self.ref_caches), backend_name=self.name)
        return ref, Engine(self.spec, self.runner.run, backend_name=self.name)


def gpu_spec(name: str) -> ca.AttentionSpec:
    block_size = 16 if name != "XFORMERS" else 64  # xFormers' paged decode reads 64-key tiles
    return GPU_CONFIG.attention_spec(block_size=block_size, num_blocks=8192 // block_size, dtype=torch.bfloat16,
                                     device="cuda", max_seq_len_to_capture=GPU_MAX_LEN)


def gpu_backend(name: str, spec: ca.AttentionSpec) -> type[ca.AttentionBackend]:
    """The backend `name` serving `spec` here, or skip the test when it cannot run here."""
    try:
        return ca.get_attn_backend(name, spec)
    except ca.BackendUnavailableError as e:  # a backend refusing the standard spec fails the test
        pytest.skip(f"{name} unavailable here: {e}")


def gpu_setup(name: str) -> GpuSetup:
    """The GPU model on `name`, its runner captured at GPU_SIZES (States made under the
    environment of the moment), and caches for the eager reference; skips without CUDA or `name`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = gpu_spec(name)
    backend = gpu_backend(name, spec)
    model = build_model(GPU_CONFIG, seed=0, backend=name, dtype=torch.bfloat16, device="cuda")
    runner = CUDAGraphRunner(model, backend, spec, allocate_kv_caches(GPU_CONFIG, backend, spec),
                             capture_sizes=GPU_SIZES, max_batch_size=max(GPU_SIZES), progress=False)
    runner.capture()
    return GpuSetup(name, backend, spec, model, runner, allocate_kv_caches(GPU_CONFIG, backend, spec))


@pytest.fixture(scope="module", params=["TORCH_SDPA", "FLASHINFER", "XFORMERS"])
def gpu(request) -> GpuSetup:
    return gpu_setup(request.param)


@pytest.mark.gpu
def test_capture_reports_time_and_pool_memory(gpu):
    stats = gpu.runner.capture_stats
    assert stats["num_graphs"] == len(GPU_SIZES) and stats["sizes"] == sorted(GPU_SIZES, reverse=True)
    assert stats["seconds"] > 0
    assert stats["pool_bytes"] is None or stats["pool_bytes"] > 0


@pytest.mark.gpu
def test_graph_decode_matches_eager_teacher_forced(gpu):
    """Batch sizes hit exact (1, 8) and padded (3 -> 4, 13 -> 16) graphs, each backend on its
    default graph decode (TORCH_SDPA: FlexAttention; its gather decode: the test below)."""
    decode_teacher_forced(gpu, (1, 3, 8, 13))


@pytest.mark.gpu
def test_flashinfer_graphs_without_split_kv_follow_each_step(monkeypatch):
    """Every size without split-kv (the threshold lowered to one pair): each replay keeps the
    capture's plan and refills only the page CSR; decode as lengths grow still equals eager."""
    monkeypatch.setattr(fib, "NO_SPLIT_KV_MIN_PAIRS", 1)
    gpu = gpu_setup("FLASHINFER")
    assert fib.decode_split_options(gpu.spec, 1) == {"disable_split_kv": True}  # the path under test
    decode_teacher_forced(gpu, (3, 8))


def test_near_tie_takes_tokens_within_four_bf16_ulps_of_the_top():
    """The GPU teacher-forced bar's rule, on CPU: bf16 ulps of the top logit's magnitude (of 1
    below 1): 2^-6 at 3.0, so 2.96875 (2 ulps down) is a near-tie and 2.90625 (6) is not."""
    logits = torch.tensor([[3.0, 2.96875, 2.90625, -1.0], [0.5, 0.4921875, 0.25, 0.0]], dtype=torch.bfloat16)
    assert near_tie(logits, torch.tensor([0, 0])).tolist() == [True, True]
    assert near_tie(logits, torch.tensor([1, 1])).tolist() == [True, True]  # 0.0078 below 0.5: one ulp of 1
    assert near_tie(logits, torch.tensor([2, 2])).tolist() == [False, False]
    assert near_tie(logits, torch.tensor([1, 2]), ulps=6).tolist() == [True, False]


@pytest.mark.gpu
def test_gather_graph_decode_matches_eager_teacher_forced(monkeypatch):
    """TORCH_SDPA's graphs pinned to the gather decode (where flex cannot serve, e.g. windows or
    ALiBi, "auto" picks it): eager's own kernel over the gathered rows, so the 99 % bar."""
    monkeypatch.setenv(sdpa_backend.GRAPH_DECODE_ENV, "gather")
    gpu = gpu_setup(SDPA)
    assert gpu.runner.state.decode_kernel == "gather" and gpu.runner.state.decodes_on_eager_kernel
    decode_teacher_forced(gpu, (1, 3, 8, 13))


def decode_teacher_forced(gpu: GpuSetup, batches: tuple[int, ...]) -> None:
    """Prompts, then DECODE_STEPS graph-replayed decodes per batch size, fed the eager reference's
    tokens: logits within 2e-2 (bf16) of eager at every step; every greedy token that differs
    from eager's a near-tie (`near_tie`: within 4 bf16 ulps of eager's top logit, by eager's
    logits); equal tokens on at least `min_top1_agreement` of the rows: 99 % for graphs on
    eager's own kernel, 97 % on another (TORCH_SDPA's default flex decode), whose flips at bf16
    near-ties are those of any two correct bf16 kernels (`compiled_attn/testing/agreement.py`)."""
    min_agreement = min_top1_agreement(gpu.runner.state.decodes_on_eager_kernel)
    agree = total = 0
    for batch in batches:
        ref, eng = gpu.engines()
        counts = dict(gpu.runner.counts)
        step = prompts(batch, seed=batch, vocab=GPU_CONFIG.vocab_size, hi=40)
        for i in range(DECODE_STEPS + 1):
            want, got = ref.step(step), eng.step(step)
            err = rel_err(got, want)
            assert err <= 2e-2, f"batch {batch}, step {i}: logits rel err {err:.3e}"
            if i:  # decode steps
                tokens = got.argmax(-1)
                assert near_tie(want, tokens).all(), f"batch {batch}, step {i}: a token flipped off a near-tie"
                agree += (tokens == want.argmax(-1)).sum().item()
                total += batch
            step = {name: [tok] for name, tok in zip(step, want.argmax(-1).tolist(), strict=True)}
        assert gpu.runner.counts["graph"] - counts["graph"] == DECODE_STEPS
        assert gpu.runner.counts["eager_prefill"] - counts["eager_prefill"] == 1
    assert agree / total >= min_agreement, f"top-1 agreement {agree}/{total}"


@pytest.mark.gpu
def test_fallbacks_take_the_eager_path_and_stay_correct(gpu):
    ref, eng = gpu.engines()
    counts = dict(gpu.runner.counts)
    vocab = GPU_CONFIG.vocab_size
    a = prompts(20, seed=100, vocab=vocab)
    names = list(a)
    steps = [
        ("eager_prefill", {k: a[k] for k in names[:4]}),
        ("eager_prefill", {**{k: a[k] for k in names[4:]}, **{k: [1] for k in names[:4]}}),  # mixed
        ("eager_oversize", {k: [2] for k in names}),  # 20 decodes > 16
        ("eager_prefill", {"long": [7] * GPU_MAX_LEN}),
        ("eager_overlong", {**{k: [3] for k in names[:3]}, "long": [4]}),
        ("graph", {k: [5] for k in names[:5]}),
    ]
    for path, batch in steps:
        before = gpu.runner.counts[path]
        err = rel_err(eng.step(batch), ref.step(batch))
        assert gpu.runner.counts[path] == before + 1, path
        assert err <= 2e-2, f"{path}: logits rel err {err:.3e}"
    assert sum(gpu.runner.counts.values()) - sum(counts.values()) == len(steps)


@pytest.mark.gpu
def test_replays_with_changing_lengths_allocate_nothing(gpu):
    spec, runner = gpu.spec, gpu.runner
    builder = gpu.backend.get_builder_cls()(spec)
    max_blocks = GPU_MAX_LEN // spec.block_size
    tables = [list(range(i * max_blocks, (i + 1) * max_blocks)) for i in range(max(GPU_SIZES))]
    rng = random.Random(0)

    def step(seq_lens: list[int]) -> None:
        n = len(seq_lens)
        md = builder.build(seq_lens, [1] * n, tables[:n])
        ids = torch.randint(GPU_CONFIG.vocab_size, (n,), device="cuda")
        pos = torch.tensor(seq_lens, device="cuda") - 1
        runner.run(md, ids, pos)

    fixed = [GPU_MAX_LEN // 2] * 5
    for _ in range(50):  # steady state first: lazily made planning buffers and freed garbage settle
        step([rng.randint(2, GPU_MAX_LEN) for _ in range(rng.randint(1, max(GPU_SIZES)))])
    step(fixed)
    gc.collect()  # earlier tests' garbage must not be freed inside the measured window
    torch.cuda.synchronize()
    before, graphs = torch.cuda.memory_allocated(), runner.counts["graph"]
    for _ in range(1000):
        step([rng.randint(2, GPU_MAX_LEN) for _ in range(rng.randint(1, max(GPU_SIZES)))])
    step(fixed)  # a state that keeps the last step's metadata holds one of the same size as before
    gc.collect()
    torch.cuda.synchronize()
    assert runner.counts["graph"] - graphs == 1001
    assert torch.cuda.memory_allocated() == before


def random_decode_step(gpu: GpuSetup, rng: random.Random, n: int) -> tuple[ca.AttentionMetadata, torch.Tensor,
                                                                           torch.Tensor]:
    """A decode step of n requests at random lengths over random distinct blocks: (md, ids, positions)."""
    spec, max_blocks = gpu.spec, GPU_MAX_LEN // gpu.spec.block_size
    seq_lens = [rng.randint(2, GPU_MAX_LEN) for _ in range(n)]
    blocks = rng.sample(range(spec.num_blocks), n * max_blocks)
    md = gpu.backend.get_builder_cls()(spec).build(
        seq_lens, [1] * n, [blocks[i * max_blocks : (i + 1) * max_blocks] for i in range(n)])
    ids = torch.randint(GPU_CONFIG.vocab_size, (n,), device="cuda")
    return md, ids, torch.tensor(seq_lens, device="cuda") - 1


@pytest.mark.gpu
def test_graph_steps_queued_behind_a_busy_gpu_each_read_their_own_metadata(gpu):
    """Each graph uploads its step's metadata itself, from the host mirror the next step
    rewrites. Queued behind a ~50 ms sleep kernel with no sync between steps, the host must wait
    for each replay's upload before writing the next step: every step equals eager's."""
    assert all(entry.prepare_kw == {"upload": False} for entry in gpu.runner._captured.values())
    rng = random.Random(5)
    steps = [random_decode_step(gpu, rng, rng.randint(1, max(GPU_SIZES))) for _ in range(6)]
    for ref, cache in zip(gpu.ref_caches, gpu.runner.kv_caches, strict=True):
        ref.copy_(cache.normal_())  # the steps read keys nobody wrote: random, not torch.empty's garbage (NaN)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e8))
    slept = torch.cuda.Event()
    slept.record()
    graphed = [gpu.runner.run(*steps[0])]
    assert not slept.query(), "the sleep ended before the first step was queued: nothing here waited"
    graphed += [gpu.runner.run(md, ids, pos) for md, ids, pos in steps[1:]]
    for i, (md, ids, pos) in enumerate(steps):
        with ca.set_forward_context(md):
            want = gpu.model(ids, pos, gpu.ref_caches)
        assert rel_err(graphed[i], want) <= 2e-2, f"step {i} of {md.num_seqs} requests"


@pytest.mark.gpu
def test_copy_output_false_returns_the_graphs_own_rows_until_the_next_step(gpu):
    rng = random.Random(6)
    (md, ids, pos), (md2, ids2, pos2) = (random_decode_step(gpu, rng, 3) for _ in range(2))
    for cache in gpu.runner.kv_caches:
        cache.normal_()  # keys nobody wrote: random, not torch.empty's garbage (NaN)
    copied = gpu.runner.run(md, ids, pos)
    own = gpu.runner.run(md, ids, pos, copy_output=False)  # the same step again: the same K/V, the same output
    assert torch.equal(own, copied)
    assert own.untyped_storage().data_ptr() == gpu.runner._output.untyped_storage().data_ptr()
    second = gpu.runner.run(md2, ids2, pos2)
    assert torch.equal(own, second) and not torch.equal(own, copied), "the next step rewrites the rows"


@pytest.mark.gpu
def test_reduce_overhead_compile_never_replays_stale_metadata(gpu):
    """PyTorch's own CUDA graphs (mode="reduce-overhead") copy only graph inputs: our
    context-reading ops are cudagraph_unsafe, so Inductor keeps them out of its graphs and every
    step attends with its own lengths and tables (eager == compiled while both change). Then the
    fixture's runner, captured before, still replays right."""
    torch._dynamo.reset()
    compiled = torch.compile(gpu.model, mode="reduce-overhead", fullgraph=True)
    ref = Engine(gpu.spec, direct(gpu.model, gpu.ref_caches), backend_name=gpu.name)
    eng = Engine(gpu.spec, direct(compiled, allocate_kv_caches(GPU_CONFIG, gpu.backend, gpu.spec)),
                 backend_name=gpu.name)
    for batch in (3, 5):
        step = prompts(batch, seed=200 + batch, vocab=GPU_CONFIG.vocab_size, hi=40)
        for i in range(9):  # a prefill, then decodes whose lengths and tables change every step
            want, got = ref.step(step), eng.step(step)
            err = rel_err(got, want)
            assert err <= 2e-2, f"batch {batch}, step {i}: logits rel err {err:.3e}"
            step = {name: [tok] for name, tok in zip(step, want.argmax(-1).tolist(), strict=True)}
    torch._dynamo.reset()
    # cudagraph trees clear cuBLAS's cached workspaces; the runner's graphs, captured earlier in
    # this process, must still replay right once that memory can be handed out again
    torch.cuda.empty_cache()
    ref, eng = gpu.engines()
    step = prompts(4, seed=300, vocab=GPU_CONFIG.vocab_size)
    for i in range(5):
        want, got = ref.step(step), eng.step(step)
        assert rel_err(got, want) <= 2e-2, f"runner after reduce-overhead, step {i}"
        step = {name: [tok] for name, tok in zip(step, want.argmax(-1).tolist(), strict=True)}


@pytest.mark.gpu
def test_replay_on_other_caches_raises(gpu):
    md = gpu.backend.get_builder_cls()(gpu.spec).build([5], [1], [[3]])
    ids = pos = torch.tensor([4], device="cuda")
    with pytest.raises(RuntimeError, match="captured with"):
        gpu.runner.run(md, ids, pos, kv_caches=[c.clone() for c in gpu.runner.kv_caches])
    with pytest.raises(ValueError, match="int64"):
        gpu.runner.run(md, ids.cpu(), pos)


@pytest.mark.gpu
def test_sdpa_graphs_of_every_table_width_match_eager(monkeypatch):
    """TORCH_SDPA's graphs over narrower tables (views of the static table, captured after the
    widest into the same pool): teacher-forced decodes whose longest row crosses 256 tokens
    replay the 256- and then the 512-token graphs and agree with eager (the gather decode, pinned:
    the default flex captures one width)."""
    monkeypatch.setenv(sdpa_backend.GRAPH_DECODE_ENV, "gather")
    spec = dataclasses.replace(gpu_spec(SDPA), max_seq_len_to_capture=1024)  # widths 64, 32, 16 blocks of 16
    backend = ca.get_attn_backend(SDPA, spec)
    model = build_model(GPU_CONFIG, seed=0, backend=SDPA, dtype=torch.bfloat16, device="cuda")
    runner = CUDAGraphRunner(model, backend, spec, allocate_kv_caches(GPU_CONFIG, backend, spec),
                             capture_sizes=[1, 2, 4], max_batch_size=4, progress=False)
    assert runner.capture()["num_graphs"] == 9
    ref = Engine(spec, direct(model, allocate_kv_caches(GPU_CONFIG, backend, spec)))
    eng = Engine(spec, runner.run)
    rng = random.Random(3)
    step = {name: [rng.randrange(GPU_CONFIG.vocab_size) for _ in range(n)] for name, n in (("a", 250), ("b", 9))}
    for i in range(12):  # a: 251..261 tokens
        want, got = ref.step(step), eng.step(step)
        assert rel_err(got, want) <= 2e-2, f"step {i}"
        step = {name: [tok] for name, tok in zip(step, want.argmax(-1).tolist(), strict=True)}
    assert runner.counts["graph"] == 11


@pytest.mark.gpu
def test_compiled_model_under_graphs_matches_eager():
    """The full stack: torch.compile(fullgraph=True, dynamic=True) captured by the runner."""
    spec = gpu_spec(SDPA)
    backend = ca.get_attn_backend(SDPA, spec)
    model = build_model(GPU_CONFIG, seed=0, backend=SDPA, dtype=torch.bfloat16, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    runner = CUDAGraphRunner(compiled, backend, spec, allocate_kv_caches(GPU_CONFIG, backend, spec),
                             capture_sizes=[1, 2, 4], max_batch_size=4, progress=False)
    runner.capture()
    ref = Engine(spec, direct(model, allocate_kv_caches(GPU_CONFIG, backend, spec)))
    eng = Engine(spec, runner.run)
    step = prompts(3, seed=7, vocab=GPU_CONFIG.vocab_size)
    for i in range(12):
        want, got = ref.step(step), eng.step(step)
        assert rel_err(got, want) <= 2e-2, f"step {i}"
        step = {name: [tok] for name, tok in zip(step, want.argmax(-1).tolist(), strict=True)}
    assert runner.counts["graph"] == 11


@pytest.mark.gpu
@pytest.mark.long(45)
@pytest.mark.parametrize("kept", ["timed", "reductions", "cublas"])
@pytest.mark.parametrize("name", ["FLASHINFER", "TORCH_SDPA"])
def test_runner_compile_serves_greedy_tokens_like_eager(name, kept, monkeypatch):
    """CUDAGraphRunner(compile=True, postprocess=argmax) with real graphs: the static batch-1
    graph, whichever compile it keeps (the timed pick, or either one forced after the timing),
    and the shared graph give eager's logits' argmax; the graph kept for batch 1 is the one
    captured from the kept compile, and a one-token eager step runs that compile too."""
    captures, capture_graph = [], CUDAGraphRunner._capture_graph
    inductor = RecordingInductor(monkeypatch)
    ran = inductor.ran

    def recording_capture(self, bs, *args):
        graph, uploads = capture_graph(self, bs, *args)
        captures.append((bs, self._compiler.use, graph))
        return graph, uploads

    monkeypatch.setattr(CUDAGraphRunner, "_capture_graph", recording_capture)
    if kept != "timed":
        timed_pick = CUDAGraphRunner._pick_one_token

        def pick(self, graphs):
            timed_pick(self, graphs)
            self._one_token_stats["compile"] = kept
            return kept

        monkeypatch.setattr(CUDAGraphRunner, "_pick_one_token", pick)
    spec = gpu_spec(name)
    backend = gpu_backend(name, spec)
    model = build_model(GPU_CONFIG, seed=0, backend=name, dtype=torch.bfloat16, device="cuda")
    torch._dynamo.reset()
    runner = CUDAGraphRunner(model, backend, spec, allocate_kv_caches(GPU_CONFIG, backend, spec),
                             capture_sizes=[1, 2, 4], max_batch_size=4, progress=False, compile=True,
                             postprocess=lambda logits: logits.argmax(-1))
    inductor.compiler = runner._compiler
    runner.capture()
    one_token = runner.capture_stats["one_token"]
    assert set(one_token["replay_ms"]) == {"reductions", "cublas"}
    assert all(ms > 0 for ms in one_token["replay_ms"].values())
    if kept == "timed":
        assert one_token["compile"] == min(one_token["replay_ms"], key=one_token["replay_ms"].get)
    else:
        assert one_token["compile"] == kept
    kept_name = one_token["compile"]
    assert runner._compiler.use == kept_name and runner._compiler.one_token_graphs == 1  # one trace, both compiles
    assert [c[0] for c in inductor.compiles if c[0] != "shared"] == list(ONE_TOKEN_COMPILES)
    batch_one = [(use, graph) for bs, use, graph in captures if bs == 1]
    assert [use for use, _ in batch_one[:2]] == list(ONE_TOKEN_COMPILES)
    assert runner._captured[1, runner.widths[0]].graph is dict(batch_one[:2])[kept_name]
    assert all(use == kept_name for use, _ in batch_one[2:])  # narrower widths
    # the compiles batch 1's calls ran: warm-ups and capture of each, then the narrower widths
    calls = runner.warmup_steps + 1
    assert [n for n in ran if n != "shared"] == [*(["reductions"] * calls), *(["cublas"] * calls),
                                                 *([kept_name] * calls * (len(runner.widths) - 1))]
    ref = Engine(spec, direct(model, allocate_kv_caches(GPU_CONFIG, backend, spec)), backend_name=name)
    eng = Engine(spec, runner.run, backend_name=name)

    three = prompts(3, seed=5, vocab=GPU_CONFIG.vocab_size)
    assert greedy_agreement(ref, eng, three, 16, first_request_after(8)) >= 0.9  # from step 9, batch 1
    assert runner.counts["graph"] == 15
    # a one-token prompt (eager, the kept compile), then its decode (the batch-1 graph)
    ran.clear()
    assert greedy_agreement(ref, eng, {"solo": [7]}, 2) >= 0.5
    assert ran == [kept_name]
    assert runner.counts["eager_prefill"] == 2 and runner.counts["graph"] == 16


@pytest.mark.gpu
@pytest.mark.long(30)
def test_runner_compile_without_the_cublas_candidate_serves_greedy_tokens_like_eager(monkeypatch):
    """Real graphs with batch 1's cuBLAS compile failing (forced): the capture warns, captures batch
    1 from the primary compile alone and keeps it, says so in its stats, and serves eager's greedy
    tokens at batch 1 and above."""
    inductor = FailingCandidate(monkeypatch, failing="cublas")
    name = "FLASHINFER"
    spec = gpu_spec(name)
    backend = gpu_backend(name, spec)
    model = build_model(GPU_CONFIG, seed=0, backend=name, dtype=torch.bfloat16, device="cuda")
    torch._dynamo.reset()
    runner = CUDAGraphRunner(model, backend, spec, allocate_kv_caches(GPU_CONFIG, backend, spec),
                             capture_sizes=[1, 2], max_batch_size=2, progress=False, compile=True,
                             postprocess=lambda logits: logits.argmax(-1))
    inductor.compiler = runner._compiler
    with pytest.warns(UserWarning, match="batch 1's 'cublas' compile .* failed"):
        runner.capture()
    one_token = runner.capture_stats["one_token"]
    assert one_token["compile"] == "reductions" and set(one_token["replay_ms"]) == {"reductions"}
    assert one_token["failed"] == {"cublas": "RuntimeError: cublas lowering broke"}
    ref = Engine(spec, direct(model, allocate_kv_caches(GPU_CONFIG, backend, spec)), backend_name=name)
    eng = Engine(spec, runner.run, backend_name=name)

    two = prompts(2, seed=6, vocab=GPU_CONFIG.vocab_size)
    assert greedy_agreement(ref, eng, two, 8, first_request_after(4)) >= 0.9  # from step 5, batch 1
    assert runner.counts["graph"] == 7
    torch._dynamo.reset()


def first_request_after(k: int) -> Callable[[int, dict], dict]:
    """`greedy_agreement`'s next_step: after step k the first request alone (batch 1's static graph)."""
    return lambda i, step: dict(list(step.items())[:1]) if i == k else step


def greedy_agreement(ref: Engine, eng: Engine, step: dict, steps: int,
                     next_step: Callable[[int, dict], dict] = lambda i, step: step) -> float:
    """`steps` steps of `eng`'s greedy tokens against `ref`'s logits, teacher-forced by eager's
    tokens (then `next_step(i, step)` may reshape the batch): tokens equal wherever eager's top-2
    margin is clear (bf16 near-ties may differ); returns the top-1 agreement over all rows."""
    agree = total = 0
    for i in range(steps):
        logits = ref.step(step)
        got, want = eng.step(step), logits.argmax(-1)
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * top2[:, 0].abs().clamp(min=1)
        assert torch.equal(got[clear], want[clear]), f"step {i}"
        agree += (got == want).sum().item()
        total += len(want)
        step = next_step(i, {k: [tok] for k, tok in zip(step, want.tolist(), strict=True)})
    return agree / total


# -------------------------------------------------------------------------------------------
# feed_back_tokens: positions from the metadata, the tokens fed back in place (CPU, no graphs)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def test_fed_back_tokens_decode_as_the_model_does_with_explicit_positions(tiny_model, monkeypatch):
    """feed_back_tokens: `run(md, ids)` takes no positions. A prefill (eager, positions from the
    host), then decodes through the static graph step, each passing the rows the last one
    returned straight back (no copy), and a decode whose first request has left (its leading
    rows): the tokens and caches of the model called step by step with explicit positions."""
    spec = cpu_spec()
    caches, ref_caches = random_caches(spec, 0), random_caches(spec, 0)
    runner = static_runner(tiny_model, spec, caches, capture_sizes=[4], max_batch_size=4, postprocess=greedy_ids,
                           feed_back_tokens=True)
    copies = []
    monkeypatch.setattr(runner_module, "fill_padded", lambda *a: copies.append(a[1]) or fill_padded(*a))
    builder, tables = sdpa_builder(spec), [list(range(1 + 6 * i, 7 + 6 * i)) for i in range(3)]
    gen = torch.Generator().manual_seed(3)
    prompt_lens = [7, 3, 12]
    ids = torch.randint(TINY.vocab_size, (sum(prompt_lens),), generator=gen)
    md = builder.build(prompt_lens, prompt_lens, tables)
    tokens = runner.run(md, ids, copy_output=False)
    want = direct(tiny_model, ref_caches)(md, ids, torch.cat([torch.arange(n) for n in prompt_lens])).argmax(-1)
    assert torch.equal(tokens, want)
    tokens, seq_lens = tokens[torch.tensor(prompt_lens).cumsum(0) - 1], list(prompt_lens)  # last rows: a new tensor
    for step in range(5):
        seq_lens = [s + 1 for s in seq_lens]
        if step == 3:  # the first request leaves: the survivors' tokens are rows 1.., which overlap rows ..n-1
            seq_lens, tables, tokens = seq_lens[1:], tables[1:], tokens[1:]
        md = builder.build(seq_lens, [1] * len(seq_lens), tables)
        want = direct(tiny_model, ref_caches)(md, tokens, torch.tensor(seq_lens) - 1).argmax(-1)
        copied = len(copies)
        fed = runner.run(md, tokens, copy_output=False)
        in_place = tokens.data_ptr() == runner._input_ids.data_ptr()
        assert len(copies) == copied + (not in_place), step
        assert torch.equal(fed, want) and fed.data_ptr() == runner._input_ids.data_ptr(), step
        assert torch.equal(runner._input_ids[len(seq_lens):], torch.zeros(4 - len(seq_lens), dtype=torch.int64))
        tokens = fed
    assert runner.counts["graph"] == 5 and runner.counts["eager_prefill"] == 1
    assert len(copies) == 2  # the prefill's last rows and the survivors' rows; the rest in place
    for a, b in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fed_back_tokens_leading_rows_of_the_last_step_need_no_copy(tiny_model, monkeypatch):
    """When later requests leave, the first rows of the last step's tokens are fed back as they
    are; the rows of those that left become pads (0), whatever the caller wrote into them."""
    spec = cpu_spec()
    caches, ref_caches = random_caches(spec, 0), random_caches(spec, 0)
    runner = static_runner(tiny_model, spec, caches, capture_sizes=[4], max_batch_size=4, postprocess=greedy_ids,
                           feed_back_tokens=True)
    copies, seen = [], []
    monkeypatch.setattr(runner_module, "fill_padded", lambda *a: copies.append(1) or fill_padded(*a))
    tokens = runner.run(decode_md(spec, [5, 9, 14]), torch.tensor([3, 1, 4]), copy_output=False)
    direct(tiny_model, ref_caches)(decode_md(spec, [5, 9, 14]), torch.tensor([3, 1, 4]), torch.tensor([4, 8, 13]))
    tokens[2] = -1  # the finished request's row, marked by the caller
    md = decode_md(spec, [6, 10])
    want = direct(tiny_model, ref_caches)(md, tokens[:2].clone(), torch.tensor([5, 9])).argmax(-1)
    real_step = runner._static_step
    monkeypatch.setattr(runner, "_static_step",
                        lambda bs: seen.append(runner._input_ids[:bs].tolist()) or real_step(bs))
    got = runner.run(md, tokens[:2], copy_output=False)
    assert copies == [1]  # only the first step's ids were copied
    assert seen[0][2:] == [0, 0] and torch.equal(got, want)


def test_fed_back_tokens_refuse_positions_and_others_require_them(tiny_model):
    spec = cpu_spec()
    fed = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1], postprocess=greedy_ids,
                        feed_back_tokens=True)
    plain = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1])
    md, ids = decode_md(spec, [5]), torch.tensor([3])
    with pytest.raises(ValueError, match="without positions"):
        fed.run(md, ids, torch.tensor([4]))
    with pytest.raises(ValueError, match="feed_back_tokens=True"):
        plain.run(md, ids)
    logits = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1], feed_back_tokens=True)
    with pytest.raises(ValueError, match="next token ids"):
        logits.run(md, ids)
    with pytest.raises(NotImplementedError, match="DECODER"):
        CUDAGraphRunner(tiny_model, ca.get_attn_backend(SDPA), cpu_spec(attn_type=ca.AttentionType.ENCODER_DECODER),
                        random_caches(spec, 0), use_cuda_graphs=False, feed_back_tokens=True)


@pytest.mark.parametrize("fed", [False, True], ids=["plain", "fed"])
def test_a_model_returning_other_than_one_tensor_raises_at_its_first_static_step(tiny_model, fed):
    """Without CUDA graphs the static step checks what the model returned, as a capture's warm-up
    does (a tuple here: a raw AttributeError from the output copy before)."""
    spec = cpu_spec()
    runner = static_runner(lambda ids, pos, caches: (tiny_model(ids, pos, caches),), spec, random_caches(spec, 0),
                           capture_sizes=[1], feed_back_tokens=fed, postprocess=(lambda out: out) if fed else None)
    with pytest.raises(ValueError, match=r"^the model must return a tensor \[num_tokens, \.\.\.\]; got tuple for 1$"):
        runner.run(decode_md(spec, [5]), torch.tensor([3]), None if fed else torch.tensor([4]))


def test_token_positions_follow_each_requests_context():
    md = sdpa_builder(cpu_spec()).build([9, 6, 4], [3, 6, 1], [[1, 2, 3], [4, 5], [6]])  # prefills, then a decode
    assert runner_module.token_positions(md, torch.device("cpu")).tolist() == [6, 7, 8, 0, 1, 2, 3, 4, 5, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["TORCH_SDPA", "FLASHINFER", "XFORMERS"])
def test_fed_back_tokens_replay_the_tokens_of_explicit_positions(name):
    """The decode graphs of a feed_back_tokens runner (positions from the State's lengths, the
    tokens written to the input buffer and fed back in place, the first request leaving midway)
    give the tokens a plain runner's graphs give with explicit positions, bit for bit: the same
    kernels on the same inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = gpu_spec(name)
    backend = gpu_backend(name, spec)
    model = build_model(GPU_CONFIG, seed=0, backend=name, dtype=torch.bfloat16, device="cuda")
    runners = []
    for fed in (False, True):
        torch.manual_seed(1)  # both runners' caches hold the same random K/V
        caches = [c.normal_() for c in allocate_kv_caches(GPU_CONFIG, backend, spec)]
        runners.append(CUDAGraphRunner(model, backend, spec, caches, capture_sizes=[4], max_batch_size=4,
                                       progress=False, postprocess=greedy_ids, feed_back_tokens=fed))
        runners[-1].capture()
    plain, fed = runners
    rng = random.Random(2)
    seq_lens = [rng.randint(2, GPU_MAX_LEN // 2) for _ in range(3)]
    per_request = GPU_MAX_LEN // spec.block_size
    tables = [list(range(1 + i * per_request, 1 + (i + 1) * per_request)) for i in range(3)]
    want = got = torch.randint(GPU_CONFIG.vocab_size, (3,), device="cuda")
    for step in range(8):
        if step == 4:  # the first request leaves
            seq_lens, tables, want, got = seq_lens[1:], tables[1:], want[1:], got[1:]  # rows that overlap their copy
        md = backend.get_builder_cls()(spec).build(seq_lens, [1] * len(seq_lens), tables)
        want = plain.run(md, want, torch.tensor(seq_lens, device="cuda") - 1)
        got = fed.run(md, got, copy_output=False)
        assert torch.equal(got, want), step
        assert got.data_ptr() == fed._input_ids.data_ptr()
        assert not fed._input_ids[len(seq_lens):].any()  # pad rows: 0
        seq_lens = [s + 1 for s in seq_lens]
    assert plain.counts["graph"] == fed.counts["graph"] == 8
    assert all(torch.equal(a, b) for a, b in zip(plain.kv_caches, fed.kv_caches, strict=True))  # the same writes


def test_a_capture_size_equal_to_a_cache_dimension_adds_no_trace(tiny_model):
    """The runner compiles with dynamic=True, which would make the caches' sizes symbols too, and
    Dynamo's duck sizing would tie a first trace at 4 rows to the block size (4): the 21-token
    prefill after it traced the model again. The runner marks its caches static: one trace serves
    both, and a 3-row decode (the 4-row graph step) after them."""
    spec = cpu_spec()
    assert spec.block_size == 4
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    caches = random_caches(spec, 0)
    runner = static_runner(tiny_model, spec, caches, capture_sizes=[4], max_batch_size=4, compile=True)
    eager_caches = [c.clone() for c in caches]
    builder = sdpa_builder(spec)
    tables = [list(range(1 + 11 * i, 12 + 11 * i)) for i in range(4)]
    steps = [([9, 5, 7, 6], [1, 1, 1, 1]), ([5, 9, 7], [5, 9, 7]), ([6, 10, 8], [1, 1, 1])]
    for seq_lens, query_lens in steps:
        md = builder.build(seq_lens, query_lens, tables[: len(seq_lens)])
        ids = torch.randint(TINY.vocab_size, (sum(query_lens),))
        positions = runner_module.token_positions(md, torch.device("cpu"))
        out = runner.run(md, ids, positions)
        with ca.set_forward_context(md):
            expected = tiny_model(ids, positions, eager_caches)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert runner.counts["graph"] == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    # caches other than the runner's, handed to run() before any trace: marked there too
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runner = static_runner(tiny_model, spec, random_caches(spec, 1), capture_sizes=[4], max_batch_size=4, compile=True)
    other = random_caches(spec, 2)
    for seq_lens in ([4], [5, 9, 7]):
        md = builder.build(seq_lens, seq_lens, tables[: len(seq_lens)])
        ids = torch.randint(TINY.vocab_size, (sum(seq_lens),))
        positions = runner_module.token_positions(md, torch.device("cpu"))
        runner.run(md, ids, positions, kv_caches=other)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


def test_fed_back_tokens_compile_no_more_than_the_plain_runner(tiny_model):
    """With compile=True, a feed_back_tokens runner traces what a plain compiled runner does
    (batch 1 apart, one shared graph): fed-back rows, views of its input buffer, add no trace, on
    the decode graphs' step or handed to the model on an eager step (a one-token step longer than
    the graphs capture)."""
    spec = cpu_spec()
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runner = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1, 2, 4], max_batch_size=4,
                           postprocess=greedy_ids, compile=True, feed_back_tokens=True)
    builder, tables = sdpa_builder(spec), [list(range(1 + 11 * i, 12 + 11 * i)) for i in range(3)]
    seq_lens = [5, 9, 7]
    tokens = runner.run(builder.build(seq_lens, seq_lens, tables), torch.randint(TINY.vocab_size, (21,)),
                        copy_output=False)[torch.tensor(seq_lens).cumsum(0) - 1]
    for step in range(5):
        seq_lens = [s + 1 for s in seq_lens]
        if step == 3:
            seq_lens, tables, tokens = seq_lens[:1], tables[:1], tokens[:1]
        tokens = runner.run(builder.build(seq_lens, [1] * len(seq_lens), tables), tokens, copy_output=False)
    traced = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    for s in range(MAX_LEN - 1, MAX_LEN + 3):  # batch 1 up to the capture's longest, then past it: eager
        tokens = runner.run(builder.build([s], [1], tables), tokens, copy_output=False)
    assert runner.counts["graph"] == 7 and runner.counts["eager_overlong"] == 2
    plain = static_runner(tiny_model, spec, random_caches(spec, 0), capture_sizes=[1, 2, 4], max_batch_size=4,
                          postprocess=greedy_ids, compile=True)
    for n in (3, 1):  # the plain runner's two traces, for the comparison
        plain.run(decode_md(spec, [9] * n), torch.zeros(n, dtype=torch.int64), torch.full((n,), 8))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2 * traced == 4

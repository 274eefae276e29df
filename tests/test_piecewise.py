"""Piecewise graphs: the split at the context ops, padding to token buckets, the runner's routing.

CPU: the split FX graph pinned (pieces and the op groups between them, which arguments are cut
to the step's tokens), the padded piecewise step without capture (`use_cuda_graphs=False`) against
the eager model on prefill, mixed, oversize and overlong steps for every CPU backend, pad tokens
writing no cache, one Dynamo compile across all buckets, the Inductor-compiled pieces. GPU
(marked): every backend's captured pieces against eager, next to the full decode graphs.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import weakref

import pytest
import torch
from expecttest import TestCase
from test_graphs import (
    GPU_CONFIG,
    GPU_MAX_LEN,
    Engine,
    direct,
    gpu_backend,
    gpu_spec,
    greedy_agreement,
    prompts,
    rel_err,
)
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import compiled_attn as ca
from compiled_attn import forward_context as fc
from compiled_attn.forward_context import get_layer
from compiled_attn.graphs import DEFAULT_PIECEWISE_SIZES, CUDAGraphRunner, choose_path
from compiled_attn.graphs import piecewise as pw
from compiled_attn.graphs.piecewise import EagerOps, GraphControl, PiecewiseBackend, PiecewiseGraphs
from compiled_attn.groups import GroupedMetadata
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 4, 128, 40
BUCKETS = [4, 8, 16, 32]


def cpu_spec(**kw) -> ca.AttentionSpec:
    return TINY.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32, device="cpu",
                               max_seq_len_to_capture=MAX_LEN, **kw)


def random_caches(spec: ca.AttentionSpec, seed: int, config: LlamaConfig = TINY) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [c.normal_() for c in allocate_kv_caches(config, ca.get_attn_backend("TORCH_SDPA"), spec)]


def piecewise_runner(model, backend, spec, caches, **kw) -> CUDAGraphRunner:
    kw = {"capture_sizes": [1, 2, 4], "max_batch_size": 4, "piecewise_sizes": BUCKETS, "piece_compiler": "eager",
          **kw}
    runner = CUDAGraphRunner(model, backend, spec, caches, use_cuda_graphs=False, progress=False, piecewise=True,
                             **kw)
    runner.capture()
    return runner


# -------------------------------------------------------------------------------------------
# Routing decisions


def test_default_buckets_go_up_to_512_tokens_padding_at_most_half_above_16(sdpa_model):
    sizes = list(DEFAULT_PIECEWISE_SIZES)
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 512
    assert all(b <= 1.5 * a for a, b in zip(sizes, sizes[1:], strict=False) if a >= 16)
    spec = cpu_spec()
    runner = CUDAGraphRunner(sdpa_model, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0),
                             use_cuda_graphs=False, piecewise=True)
    assert runner.piecewise.sizes == sizes[::-1]


@pytest.mark.parametrize(
    ("num_prefills", "num_seqs", "num_tokens", "max_seq_len", "path"),
    [
        (0, 3, 3, 64, "graph"),  # decode-only that fits: the full decode graphs, as before
        (1, 3, 40, 64, "piecewise"),  # mixed
        (2, 2, 64, 64, "piecewise"),  # prefill-only, exactly the largest bucket
        (2, 2, 65, 64, "eager_prefill"),  # above the largest bucket
        (0, 17, 17, 10, "piecewise"),  # more decodes than the largest decode graph
        (0, 4, 4, 65, "piecewise"),  # overlong: the eager attention reads any length
        (0, 70, 70, 65, "eager_oversize"),
    ],
)
def test_path_choice_with_piecewise_buckets(num_prefills, num_seqs, num_tokens, max_seq_len, path):
    got = choose_path(num_prefills=num_prefills, num_seqs=num_seqs, max_seq_len=max_seq_len, largest_size=16,
                      max_seq_len_to_capture=64, num_tokens=num_tokens, largest_piecewise_tokens=64)
    assert got == path


# -------------------------------------------------------------------------------------------
# The split graph


def normalize(text: str) -> str:
    return re.sub(r"'(\w+Impl\.\w+)\.\d+'", r"'\1.N'", text)


def split_summary(backend: PiecewiseBackend) -> str:
    """Each submodule in order: a piece's input count and output shapes; an op group's calls and
    which of its arguments are cut to the step's tokens."""
    lines = []
    for piece in backend.pieces:
        graph = piece.module.graph
        inputs = [n.name for n in graph.find_nodes(op="placeholder")]
        if not piece.is_op_group:
            outputs = graph.output_node().args[0]
            outputs = outputs if isinstance(outputs, tuple | list) else (outputs,)
            shapes = ", ".join(_shape(n.meta["example_value"]) for n in outputs)
            lines.append(f"{piece.name}: piece, {len(inputs)} inputs -> {shapes}")
            continue
        wrapper = backend.split_module.__dict__[piece.name]
        assert isinstance(wrapper, EagerOps)
        lines.append(f"{piece.name}: eager ops, token rows cut: {[inputs[i] for i in wrapper.token_args]}")
        for node in (n for n in graph.nodes if n.op == "call_function"):
            args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in node.args)
            lines.append(f"    {node.target}({args})")
    return normalize("\n".join(lines))


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


class TestSplit(TestCase):
    def test_model_splits_once_per_layer_around_both_ops(self):
        torch._dynamo.reset()
        config = dataclasses.replace(TINY, num_layers=1)
        model = build_model(config, seed=0, backend="TORCH_SDPA")
        spec = config.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32, device="cpu")
        backend = PiecewiseBackend(GraphControl(use_graphs=False), "eager")
        md = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(spec).build([5, 9], [5, 1], [[0, 1], [2, 3, 4]])
        ids, pos = torch.randint(config.vocab_size, (6,)), torch.tensor([0, 1, 2, 3, 4, 8])
        ca.mark_token_dim(ids, pos)
        with ca.set_forward_context(md):
            torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(
                ids, pos, random_caches(spec, 0, config))
        self.assertExpectedInline(split_summary(backend), """\
submod_0: piece, 9 inputs -> float32[u1, 4, 16], float32[u1, 2, 16], float32[u1, 2, 16], float32[u1, 4, 16], float32[u1, 64]
submod_1: eager ops, token rows cut: ['q_2', 'k_2', 'v_1', 'output']
    compiled_attn.kv_cache_update(q_2, k_2, v_1, l_kv_caches_0_, 'TorchSDPAImpl.decoder.N')
    compiled_attn.torch_sdpa_attention(q_2, k_2, v_1, l_kv_caches_0_, output, 'TorchSDPAImpl.decoder.N')
submod_2: piece, 10 inputs -> float32[u1, 128]""")


    def test_captured_pieces_keep_each_layers_cache_write(self):
        """With graphs the cache write stays in the piece before it (captured over the static
        slots); only attention runs eagerly, and the backend knows each write's layer, shapes
        and cache."""
        torch._dynamo.reset()
        config = dataclasses.replace(TINY, num_layers=1)
        model = build_model(config, seed=0, backend="TORCH_SDPA")
        spec = config.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32, device="cpu")
        backend = PiecewiseBackend(GraphControl(use_graphs=True), "eager", captures_writes=True)
        md = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(spec).build([5, 9], [5, 1], [[0, 1], [2, 3, 4]])
        ids, pos = torch.randint(config.vocab_size, (6,)), torch.tensor([0, 1, 2, 3, 4, 8])
        ca.mark_token_dim(ids, pos)
        caches = random_caches(spec, 0, config)
        with ca.set_forward_context(md):
            torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(ids, pos, caches)
        self.assertExpectedInline(split_summary(backend), """\
submod_0: piece, 10 inputs -> float32[u1, 4, 16], float32[u1, 2, 16], float32[u1, 2, 16], float32[u1, 4, 16], float32[u1, 64]
submod_1: eager ops, token rows cut: ['q_2', 'k_2', 'v_1', 'output']
    compiled_attn.torch_sdpa_attention(q_2, k_2, v_1, l_kv_caches_0_, output, 'TorchSDPAImpl.decoder.N')
submod_2: piece, 10 inputs -> float32[u1, 128]""")
        piece = backend.pieces[0].module
        writes = [n for n in piece.graph.nodes if n.op == "call_function" and "kv_cache_update" in str(n.target)]
        assert len(writes) == 1
        [write] = backend.writes
        assert write.call is get_layer(writes[0].args[-1]) and write.cache is caches[0]
        assert (write.dtype, write.query_shape, write.key_shape) == (torch.float32, (4, 16), (2, 16))


def test_ops_without_a_symbolic_token_count_are_refused(sdpa_model):
    """Unmarked inputs compile to static shapes: nothing tells the op groups which rows are the
    step's, so the backend refuses at compile time rather than hand the ops padded rows."""
    spec = cpu_spec()
    backend = PiecewiseBackend(GraphControl(use_graphs=False), "eager")
    md = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(spec).build([3], [3], [[5]])
    with ca.set_forward_context(md), pytest.raises(Exception, match="token count as its first dimension") as info:
        torch.compile(sdpa_model, backend=backend, fullgraph=True, dynamic=False)(
            torch.tensor([1, 2, 3]), torch.arange(3), random_caches(spec, 0))
    assert isinstance(getattr(info.value, "inner_exception", info.value), NotImplementedError)


# -------------------------------------------------------------------------------------------
# The padded piecewise step without capture (CPU)


@pytest.fixture
def cpu_model(cpu_backend):
    torch._dynamo.reset()
    return build_model(TINY, seed=0, backend=cpu_backend.get_name())


@pytest.fixture
def sdpa_model():
    torch._dynamo.reset()
    return build_model(TINY, seed=0, backend="TORCH_SDPA")


def test_piecewise_steps_match_eager(cpu_backend, cpu_model):
    """Prefill, mixed, oversize and overlong steps padded to their buckets give eager's logits;
    decode steps that fit still take the full decode graphs."""
    spec = cpu_spec()
    name = cpu_backend.get_name()
    runner = piecewise_runner(cpu_model, cpu_backend, spec, random_caches(spec, 0))
    ref = Engine(spec, direct(cpu_model, random_caches(spec, 0)), backend_name=name)
    eng = Engine(spec, runner.run, backend_name=name)
    a = prompts(6, seed=1, vocab=TINY.vocab_size, lo=2, hi=6)
    names = list(a)
    steps = [
        ("piecewise", {k: a[k] for k in names[:3]}),  # prefill of 3 prompts (bucket 16)
        ("piecewise", {**{k: a[k] for k in names[3:]}, **{k: [1] for k in names[:3]}}),  # mixed
        ("graph", {k: [2] for k in names[:3]}),
        ("piecewise", {k: [3] for k in names}),  # 6 decodes > the largest decode size 4
        ("eager_prefill", {"long": [5] * MAX_LEN}),  # a 40-token prompt: above the largest bucket, 32
        ("piecewise", {"long": [6], **{k: [7] for k in names[:2]}}),  # overlong decode (41 > 40 tokens)
    ]
    for path, batch in steps:
        before = runner.counts[path]
        torch.testing.assert_close(eng.step(batch), ref.step(batch), rtol=1e-5, atol=1e-5)
        assert runner.counts[path] == before + 1, path


def test_a_runner_without_decode_sizes_serves_every_step_through_the_pieces(cpu_backend, cpu_model):
    """capture_sizes=[] with piecewise=True: no decode graph and no whole-model compile for one
    (one Dynamo graph: the piecewise trace); decode steps take the pieces as the prefill does,
    with eager's logits."""
    from torch._dynamo.utils import counters

    spec = cpu_spec()
    name = cpu_backend.get_name()
    graphs_before = counters["stats"]["unique_graphs"]
    runner = piecewise_runner(cpu_model, cpu_backend, spec, random_caches(spec, 0), capture_sizes=[], compile=True)
    assert runner.sizes == [] and runner.capture_stats["num_graphs"] == 0
    ref = Engine(spec, direct(cpu_model, random_caches(spec, 0)), backend_name=name)
    eng = Engine(spec, runner.run, backend_name=name)
    a = prompts(3, seed=2, vocab=TINY.vocab_size, lo=2, hi=6)
    for batch in (a, {k: [1] for k in a}, {k: [2] for k in a}):  # a prefill, then two decode steps
        torch.testing.assert_close(eng.step(batch), ref.step(batch), rtol=1e-5, atol=1e-5)
    assert runner.counts["piecewise"] == 3 and runner.counts["graph"] == 0
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_no_decode_sizes_without_piecewise_is_refused(sdpa_model):
    spec = cpu_spec()
    with pytest.raises(ValueError, match=r"capture_sizes=\[\] captures no graph: pass piecewise=True"):
        CUDAGraphRunner(sdpa_model, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0),
                        use_cuda_graphs=False, capture_sizes=[])


@pytest.mark.parametrize(("kw", "match"), [
    ({"piecewise_sizes": [8]}, "piecewise_sizes without piecewise=True"),
    ({"piece_compiler": "eager"}, "piece_compiler='eager' without piecewise=True"),
    ({"piece_compiler": "bogus"}, r"piece_compiler must be one of \('inductor', 'eager'\), got 'bogus'"),
    ({"piece_compiler": "bogus", "piecewise": True}, "piece_compiler must be one of"),
], ids=["sizes", "eager", "unknown", "unknown-piecewise"])
def test_piecewise_options_are_checked_whether_or_not_piecewise_is_on(sdpa_model, kw, match):
    spec = cpu_spec()
    with pytest.raises(ValueError, match=match):
        CUDAGraphRunner(sdpa_model, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0),
                        use_cuda_graphs=False, **kw)


def test_pad_tokens_write_no_cache(cpu_model, cpu_backend):
    """A 5-token step in bucket 8: the caches equal eager's after the step, bit for bit outside
    the step's own slots (pad rows' K/V never reach the cache)."""
    spec = cpu_spec()
    caches = random_caches(spec, 0)
    before = [c.clone() for c in caches]
    runner = piecewise_runner(cpu_model, cpu_backend, spec, caches)
    ref_caches = random_caches(spec, 0)
    md = cpu_backend.get_builder_cls()(spec).build([5], [5], [[7, 9]])
    ids, pos = torch.randint(TINY.vocab_size, (5,)), torch.arange(5)
    direct(cpu_model, ref_caches)(md, ids, pos)
    runner.run(md, ids, pos)
    slots = md.slot_mapping
    for got, want, old in zip(caches, ref_caches, before, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        flat_got, flat_old = got.flatten(1, 2), old.flatten(1, 2)  # [2, num_blocks * block_size, H, D]
        untouched = torch.ones(flat_got.shape[1], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(flat_got[:, untouched], flat_old[:, untouched])
    assert runner.counts["piecewise"] == 1


def test_op_groups_call_the_ops_kernels_without_the_dispatcher(sdpa_model):
    """Between pieces the cache write and attention run as their Python kernels: no call of ours
    reaches the dispatcher (a dispatch mode sees every op that does), and the step equals eager."""
    spec = cpu_spec()
    runner = piecewise_runner(sdpa_model, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0))
    md = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(spec).build([5], [5], [[7, 9]])
    ids, pos = torch.randint(TINY.vocab_size, (5,)), torch.arange(5)
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.namespace)
            return func(*args, **(kwargs or {}))

    runner.run(md, ids, pos)  # the bucket's first step goes through Dynamo, which a dispatch mode turns off
    with Record():
        got = runner.run(md, ids, pos)
    assert runner.counts["piecewise"] == 2 and "aten" in seen and "compiled_attn" not in seen
    want = direct(sdpa_model, random_caches(spec, 0))(md, ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_compile_serves_every_bucket_and_the_unpadded_path(sdpa_model):
    spec = cpu_spec()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runner = piecewise_runner(sdpa_model, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0))
    ref, eng = Engine(spec, direct(sdpa_model, random_caches(spec, 0))), Engine(spec, runner.run)
    g = torch.Generator().manual_seed(5)
    # prompt lengths per step: buckets 4, 16, 32, 8, then 40 tokens > 32 (unpadded, no graphs)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, lens in enumerate(([3], [5, 6], [30], [1, 6], [40])):
            batch = {f"s{i}.{j}": torch.randint(TINY.vocab_size, (n,), generator=g).tolist()
                     for j, n in enumerate(lens)}
            torch.testing.assert_close(eng.step(batch), ref.step(batch), rtol=1e-5, atol=1e-5)
    assert (runner.counts["piecewise"], runner.counts["eager_prefill"]) == (4, 1)
    assert runner.piecewise.backend.num_compiles == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("given", [list, tuple])
def test_caches_passed_as_a_tuple_serve_the_unpadded_path_without_a_recompile(sdpa_model, given):
    """A tuple of caches is accepted wherever a list is, at construction and per call; a step past
    the largest bucket (the compiled pieces at its own size) takes it without Dynamo tracing the
    model again."""
    spec = cpu_spec()
    caches = random_caches(spec, 0)
    runner = piecewise_runner(sdpa_model, ca.get_attn_backend("TORCH_SDPA"), spec, given(caches))
    builder = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(spec)
    n = max(BUCKETS) + 3  # past the largest bucket
    ids, pos = torch.randint(TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(3)), torch.arange(n)
    table = list(range(1, -(-n // BLOCK_SIZE) + 1))
    runner.run(builder.build([n], [n], [table]), ids, pos, kv_caches=caches)
    with torch._dynamo.config.patch(error_on_recompile=True):
        runner.run(builder.build([n], [n], [table]), ids, pos)  # the runner's own caches
        got = runner.run(builder.build([n], [n], [table]), ids, pos, kv_caches=tuple(caches))
    assert runner.counts["eager_prefill"] == 3 and runner.piecewise.backend.num_compiles == 1
    want = direct(sdpa_model, random_caches(spec, 0))(builder.build([n], [n], [table]), ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_inductor_pieces_match_eager_with_postprocess():
    """The pieces compiled by Inductor (symbolic token count), sampling inside the last piece."""
    torch._dynamo.reset()
    config = dataclasses.replace(TINY, num_layers=1)
    model = build_model(config, seed=0, backend="TORCH_SDPA")
    spec = config.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32, device="cpu",
                                 max_seq_len_to_capture=MAX_LEN)
    runner = piecewise_runner(model, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0, config),
                              piece_compiler="inductor", postprocess=lambda logits: logits.argmax(-1))
    assert runner.capture_stats["piecewise"]["num_pieces"] == 2
    ref = Engine(spec, direct(model, random_caches(spec, 0, config)))
    eng = Engine(spec, lambda md, ids, pos: torch.nn.functional.one_hot(runner.run(md, ids, pos), config.vocab_size))
    step = prompts(3, seed=4, vocab=config.vocab_size, lo=2, hi=9)
    for i in range(4):  # a prefill, then mixed steps: a new prompt joins the decodes each time
        want = ref.step(step).argmax(-1)
        assert torch.equal(eng.step(step).argmax(-1), want), f"step {i}"
        decodes = {k: [t] for k, t in zip(step, want.tolist(), strict=True)}
        step = {**prompts(1, seed=20 + i, vocab=config.vocab_size, lo=2, hi=5), **decodes}
    assert runner.counts["piecewise"] == 4
    assert runner.piecewise.backend.num_compiles == 1


class ReplayOnCPU:
    """A CPU stand-in for a captured piece's CUDA graph: replay re-runs the piece on the tensors it
    was captured with, under the forward context it was captured in (its cache writes read the
    bucket's static slots, as the captured kernels do), and writes the results into the outputs
    of the capture, which is what a real replay does (fixed addresses in, fixed addresses out,
    whatever the call passes)."""

    def __init__(self, fn, args, outputs, context) -> None:
        self.fn, self.args, self.outputs = fn, args, outputs  # held: the addresses stay valid on CPU
        self.context = context

    def replay(self) -> None:
        with fc._entered(self.context):
            fresh = self.fn(*self.args)
        for old, new in zip(torch.utils._pytree.tree_leaves(self.outputs), torch.utils._pytree.tree_leaves(fresh),
                            strict=True):
            old.copy_(new)


def capture_on_cpu(fn, args, pool):
    context = ca.get_forward_context()
    outputs = fn(*args)
    return ReplayOnCPU(fn, args, outputs, context), outputs


@pytest.fixture
def cpu_replays(monkeypatch):
    """Captures in this test made by `capture_on_cpu`: graphs simulated on CPU."""
    monkeypatch.setattr(pw, "capture_graph", capture_on_cpu)


def cpu_graphs(model, caches, sizes, piece_compiler="eager") -> PiecewiseGraphs:
    """Piecewise graphs on CPU as with CUDA graphs (captured writes included), one warm-up a
    bucket; capture them under the `cpu_replays` fixture."""
    return PiecewiseGraphs(model, caches, sizes=sizes, device=torch.device("cpu"), use_cuda_graphs=True,
                           piece_compiler=piece_compiler, warmup_steps=1)


def test_replays_of_captured_pieces_match_eager(cpu_replays, sdpa_model):
    """The capture / replay bookkeeping with graphs simulated on CPU: ops skipped while capturing,
    each piece replayed on its captured inputs (the static buffers, the previous pieces' outputs
    that the eager ops wrote in between), buckets interleaved; the outputs equal eager's."""
    spec = cpu_spec()
    caches = random_caches(spec, 0)
    graphs = cpu_graphs(sdpa_model, caches, sorted(BUCKETS, reverse=True))
    assert graphs.capture()["num_graphs"] == (TINY.num_layers + 1) * len(BUCKETS)
    assert all(sorted(p.graphs) == BUCKETS for p in graphs.backend.split_module.__dict__.values()
               if isinstance(p, pw.CapturedPiece))
    ref_caches = random_caches(spec, 0)
    ref, eng = Engine(spec, direct(sdpa_model, ref_caches)), Engine(spec, graphs.run)
    step = prompts(3, seed=8, vocab=TINY.vocab_size, lo=2, hi=8)
    for i in range(6):  # a prefill (bucket 16 or 32), then 3-token steps (bucket 4) with a new prompt now and then
        want = ref.step(step)
        torch.testing.assert_close(eng.step(step), want, rtol=1e-5, atol=1e-5)
        step = {k: [t] for k, t in zip(step, want.argmax(-1).tolist(), strict=True)}
        if i % 2:
            step = {**prompts(1, seed=30 + i, vocab=TINY.vocab_size, lo=2, hi=6), **step}
    for got, want in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_inductor_pieces_write_the_cache_in_place_and_match_eager(cpu_replays):
    """Inductor compiles a piece with its layer's cache write like the whole model's: the op on the
    cache argument itself (no copy of the cache in or out); replayed (simulated), steps match
    eager, caches included."""
    torch._dynamo.reset()
    config = dataclasses.replace(TINY, num_layers=1)
    model = build_model(config, seed=0, backend="TORCH_SDPA")
    spec = cpu_spec()
    caches = random_caches(spec, 0, config)
    graphs = cpu_graphs(model, caches, [16, 4], piece_compiler="inductor")
    with torch._inductor.config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(graphs.capture)
    [code] = [c for c in codes if "kv_cache_update" in c]
    assert re.search(r"compiled_attn\.kv_cache_update\.default\([^\n]*, arg\d+_1, '", code), code
    assert "copy_" not in code and "clone" not in code, code
    ref_caches = random_caches(spec, 0, config)
    ref, eng = Engine(spec, direct(model, ref_caches)), Engine(spec, graphs.run)
    step = prompts(2, seed=6, vocab=config.vocab_size, lo=2, hi=7)
    for i in range(3):  # a prefill (bucket 16), then decodes (bucket 4)
        want = ref.step(step)
        torch.testing.assert_close(eng.step(step), want, rtol=1e-5, atol=1e-5, msg=f"step {i}")
        step = {k: [t] for k, t in zip(step, want.argmax(-1).tolist(), strict=True)}
    for got, want in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_steps_after_the_first_per_bucket_bypass_dynamo(cpu_replays, sdpa_model):
    """A bucket's first step goes through Dynamo and records the split module's inputs; later steps
    call it directly: with Dynamo's caches dropped and under another grad mode they compile
    nothing and still match eager."""
    spec = cpu_spec()
    graphs = cpu_graphs(sdpa_model, random_caches(spec, 0), [8, 4])
    graphs.capture()
    assert sorted(graphs._direct) == [4, 8] and graphs.backend.recorded == {}
    torch._dynamo.reset()
    ref = Engine(spec, direct(sdpa_model, random_caches(spec, 0)))
    eng = Engine(spec, graphs.run)
    step = prompts(2, seed=9, vocab=TINY.vocab_size, lo=2, hi=4)
    for i in range(3):
        want = ref.step(step)
        with torch.no_grad():  # the caller's grad mode is not the pieces' concern: they always run without grad
            torch.testing.assert_close(eng.step(step), want, rtol=1e-5, atol=1e-5, msg=f"step {i}")
        step = {k: [t] for k, t in zip(step, want.argmax(-1).tolist(), strict=True)}
    assert graphs.backend.num_compiles == 1


def test_a_step_the_captured_writes_refuse_raises_before_anything_is_written(cpu_replays, sdpa_model):
    """Nothing runs for a captured write at replay, so the graphs check the step first as its op
    would: metadata built for another cache size or another spec's heads, of several layer groups
    (the layers have none), or whose slots are not the step's tokens raises the op's error and
    leaves every cache and the static slots as they were."""
    spec = cpu_spec()
    caches = random_caches(spec, 0)
    graphs = cpu_graphs(sdpa_model, caches, [8])
    graphs.capture()
    ids, pos = torch.randint(TINY.vocab_size, (5,)), torch.arange(5)
    before = [c.clone() for c in caches]
    sdpa = ca.get_attn_backend("TORCH_SDPA")
    for other, match in ((dataclasses.replace(spec, num_blocks=spec.num_blocks * 2), "kv_cache has shape"),
                         (dataclasses.replace(spec, num_kv_heads=spec.num_heads), "num_kv_heads")):
        md = sdpa.get_builder_cls()(other).build([5], [5], [[7, 9]])
        with pytest.raises(ValueError, match=match):
            graphs.run(md, ids, pos)
        assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
        assert torch.equal(graphs._slots, torch.full_like(graphs._slots, -1))
    md = sdpa.get_builder_cls()(spec).build([5], [5], [[7, 9]])
    grouped = GroupedMetadata.of({"a": md, "b": sdpa.get_builder_cls()(spec).build([5], [5], [[3, 4]])})
    for bad, match in ((grouped, "this layer has no group"),
                       (dataclasses.replace(md, slot_mapping=md.slot_mapping[:4]), "slot_mapping has shape")):
        with pytest.raises(ValueError, match=match):
            graphs.run(bad, ids, pos)
        assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
    # the spec's own metadata is served
    torch.testing.assert_close(graphs.run(md, ids, pos), direct(sdpa_model, random_caches(spec, 0))(md, ids, pos),
                               rtol=1e-5, atol=1e-5)


def test_captured_writes_stay_checked_against_their_own_caches(cpu_replays, sdpa_model):
    """Misuse around the captured writes writes nothing: a recompile for other caches (an unpadded
    step given larger ones) leaves the captured pieces checked against the caches they write; a
    second capture after a step records over pads again; input rows that are not the metadata's
    tokens are refused before the static buffers are filled."""
    spec = cpu_spec()
    caches = random_caches(spec, 0)
    graphs = cpu_graphs(sdpa_model, caches, [8])
    graphs.capture()
    sdpa = ca.get_attn_backend("TORCH_SDPA")
    md = sdpa.get_builder_cls()(spec).build([5], [5], [[7, 9]])
    ids, pos = torch.randint(TINY.vocab_size, (5,)), torch.arange(5)
    graphs.run(md, ids, pos)
    big = dataclasses.replace(spec, num_blocks=spec.num_blocks * 2)
    graphs.run_unpadded(sdpa.get_builder_cls()(big).build([10], [10], [[1, 2, 3]]), torch.randint(TINY.vocab_size, (10,)),
                        torch.arange(10), random_caches(big, 1))
    assert graphs.backend.num_compiles == 2
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match="kv_cache has shape"):  # slots beyond the captured caches
        graphs.run(sdpa.get_builder_cls()(big).build([5], [5], [[200, 201]]), ids, pos)
    graphs.capture()  # the static slots still hold the first step's
    with pytest.raises(ValueError, match="rows but the metadata describes 1 tokens"):
        graphs.run(sdpa.get_builder_cls()(spec).build([1], [1], [[7]]), ids, pos)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


def test_grouped_layers_keep_their_cache_writes_eager(cpu_replays):
    """Layers of layer groups write at their own group's slots, which one static buffer cannot
    hold: their writes stay eager ops, nothing is captured over the slots, and a grouped step
    through the (simulated) replays equals eager, caches included."""
    torch._dynamo.reset()
    sdpa = ca.get_attn_backend("TORCH_SDPA")
    specs = {name: ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, block_size=4, num_blocks=32,
                                    dtype=torch.float32, device="cpu", sliding_window=window)
             for name, window in (("full", None), ("window", 5))}
    layers = {name: ca.Attention(4, 16, 0.25, num_kv_heads=2, sliding_window=s.sliding_window, backend="TORCH_SDPA",
                                 group=name) for name, s in specs.items()}
    g = torch.Generator().manual_seed(0)
    table, wq, wkv = torch.randn(16, 32, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, 32, generator=g)

    def model(input_ids, positions, kv_caches):
        x = torch.nn.functional.embedding(input_ids, table) * (1 + positions[:, None] / 32)
        q, kv = x @ wq, x @ wkv
        return sum(layer(q, kv, kv, cache) for layer, cache in zip(layers.values(), kv_caches, strict=True))

    caches = [torch.randn(sdpa.get_kv_cache_shape(32, 4, 2, 16), generator=g) for _ in specs]
    graphs = cpu_graphs(model, caches, [8])
    graphs.capture()
    assert graphs.backend.writes == [] and graphs.capture_stats["num_op_groups"] == 2  # a write and attention each
    tables = {"full": [[1, 2], [3]], "window": [[4, 5], [6]]}
    md = GroupedMetadata.of({name: sdpa.get_builder_cls()(s).build([6, 2], [6, 1], tables[name])
                             for name, s in specs.items()})
    ids, pos = torch.tensor([3, 5, 7, 1, 2, 9, 4]), torch.tensor([0, 1, 2, 3, 4, 5, 1])
    eager_caches = [c.clone() for c in caches]
    with ca.set_forward_context(md):
        want = model(ids, pos, eager_caches)
    torch.testing.assert_close(graphs.run(md, ids, pos), want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_model_returning_more_than_one_tensor_is_refused():
    torch._dynamo.reset()
    spec = cpu_spec()
    model = build_model(TINY, seed=0, backend="TORCH_SDPA")
    graphs = PiecewiseGraphs(lambda ids, pos, caches: (model(ids, pos, caches), ids), random_caches(spec, 0),
                             sizes=[4], device=torch.device("cpu"), use_cuda_graphs=False, piece_compiler="eager")
    with pytest.raises(ValueError, match=r"^the model must return a tensor \[num_tokens, \.\.\.\]; got tuple for 4$"):
        graphs.capture()  # its warm-up, without CUDA graphs too


def test_a_model_returning_other_rows_than_its_tokens_is_refused_before_capture(monkeypatch):
    """A model returning its last row only would have the graphs hand back a pad row's logits."""
    torch._dynamo.reset()
    captured = []
    monkeypatch.setattr(pw, "capture_graph", lambda *a: captured.append(a) or capture_on_cpu(*a))
    spec = cpu_spec()
    model = build_model(TINY, seed=0, backend="TORCH_SDPA")
    graphs = cpu_graphs(lambda ids, pos, caches: model(ids, pos, caches)[-1:], random_caches(spec, 0), [8])
    with pytest.raises(ValueError, match=r"^the model must return a tensor \[num_tokens, \.\.\.\]; "
                                         rf"got Tensor \(1, {TINY.vocab_size}\) for 8$"):
        graphs.capture()
    assert not captured


def test_capture_stats_report_the_piecewise_graphs(sdpa_model):
    spec = cpu_spec()
    runner = piecewise_runner(sdpa_model, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0))
    stats = runner.capture_stats["piecewise"]
    assert stats["sizes"] == sorted(BUCKETS, reverse=True)
    assert (stats["num_pieces"], stats["num_op_groups"]) == (TINY.num_layers + 1, TINY.num_layers)
    assert stats["num_graphs"] == 0 and stats["pool_bytes"] is None  # no capture on CPU
    assert stats["seconds"] > 0 and runner.capture_stats["seconds"] >= stats["seconds"]


def test_piecewise_needs_decoder_specs(sdpa_model):
    spec = cpu_spec(attn_type=ca.AttentionType.ENCODER_ONLY)
    with pytest.raises(NotImplementedError, match="DECODER"):
        CUDAGraphRunner(sdpa_model, ca.get_attn_backend("TORCH_SDPA"), spec, [], use_cuda_graphs=False,
                        piecewise=True)


@pytest.mark.parametrize(("kw", "match"), [
    ({"piecewise_sizes": [8]}, "piecewise=True"),
    ({"piecewise": True, "piece_compiler": "aot"}, "piece_compiler"),
    ({"piecewise": True, "piecewise_sizes": [0, 8]}, r"^piecewise_sizes must be ints in \[1, 2147483647\], got \[0\]$"),
    ({"piecewise": True, "piecewise_sizes": [2**31, 64]},  # not dropped: no largest size applies to buckets
     r"^piecewise_sizes must be ints in \[1, 2147483647\], got \[2147483648\]$"),
    ({"piecewise": True, "piecewise_sizes": 8}, "^piecewise_sizes must be a list of ints, got int$"),
    ({"piecewise": True, "piecewise_sizes": []}, "at least one"),
])
def test_bad_piecewise_arguments_raise(sdpa_model, kw, match):
    spec = cpu_spec()
    with pytest.raises(ValueError, match=match):
        CUDAGraphRunner(sdpa_model, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0),
                        use_cuda_graphs=False, **kw)


def test_run_takes_the_eager_module_behind_a_compiled_model(sdpa_model):
    spec = cpu_spec()
    compiled = torch.compile(sdpa_model, fullgraph=True, dynamic=True)
    runner = piecewise_runner(compiled, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0))
    assert runner.piecewise.compiled._orig_mod is sdpa_model


# -------------------------------------------------------------------------------------------
# GPU: captured pieces, every available backend

GPU_BUCKETS = [8, 16, 32, 64, 128]


@pytest.fixture(scope="module", params=["TORCH_SDPA", "FLASHINFER", "XFORMERS"])
def gpu_piecewise(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    name, spec = request.param, gpu_spec(request.param)
    backend = gpu_backend(name, spec)
    torch._dynamo.reset()
    model = build_model(GPU_CONFIG, seed=0, backend=name, dtype=torch.bfloat16, device="cuda")
    runner = CUDAGraphRunner(model, backend, spec, allocate_kv_caches(GPU_CONFIG, backend, spec),
                             capture_sizes=[1, 2, 4, 8], max_batch_size=8, progress=False, piecewise=True,
                             piecewise_sizes=GPU_BUCKETS)
    runner.capture()
    return name, spec, model, runner


@pytest.mark.gpu
def test_captured_pieces_match_eager(gpu_piecewise):
    """Prefill, mixed, oversize and overlong steps replay captured pieces of several buckets,
    interleaved with the full decode graphs, and agree with eager; one compile for all."""
    name, spec, model, runner = gpu_piecewise
    backend = ca.get_attn_backend(name, spec)
    ref = Engine(spec, direct(model, allocate_kv_caches(GPU_CONFIG, backend, spec)), backend_name=name)
    eng = Engine(spec, runner.run, backend_name=name)
    counts = dict(runner.counts)
    a = prompts(12, seed=40, vocab=GPU_CONFIG.vocab_size, lo=3, hi=30)
    names = list(a)
    steps = [
        ("piecewise", {k: a[k] for k in names[:3]}),
        ("graph", {k: [1] for k in names[:3]}),
        ("piecewise", {**{k: a[k] for k in names[3:5]}, **{k: [2] for k in names[:3]}}),  # mixed
        ("piecewise", {**{k: a[k] for k in names[5:9]}, **{k: [3] for k in names[:5]}}),  # 69 tokens: bucket 128
        ("piecewise", {**{k: a[k] for k in names[9:]}, **{k: [3] for k in names[:9]}}),
        ("piecewise", {k: [4] for k in names}),  # 12 decodes > 8
        ("graph", {k: [5] for k in names[:8]}),
        ("piecewise", {"long": [6] * GPU_MAX_LEN}),  # 128 tokens: the largest bucket exactly
        ("piecewise", {"long": [7], **{k: [8] for k in names[:2]}}),  # overlong decode
        ("eager_prefill", {"huge": [9] * 200}),  # above the largest bucket
        ("piecewise", {k: [10] for k in names[:9]}),
    ]
    for i, (path, batch) in enumerate(steps):
        before = runner.counts[path]
        err = rel_err(eng.step(batch), ref.step(batch))
        assert runner.counts[path] == before + 1, (i, path)
        assert err <= 2e-2, f"step {i} ({path}): logits rel err {err:.3e}"
    assert sum(runner.counts.values()) - sum(counts.values()) == len(steps)
    assert runner.piecewise.backend.num_compiles == 1


@pytest.mark.gpu
def test_piecewise_capture_reports_time_and_pool(gpu_piecewise):
    _, _, _, runner = gpu_piecewise
    stats = runner.capture_stats
    pw = stats["piecewise"]
    assert pw["num_pieces"] == GPU_CONFIG.num_layers + 1
    assert pw["num_graphs"] == pw["num_pieces"] * len(GPU_BUCKETS)
    assert 0 < pw["seconds"] <= stats["seconds"]
    assert 0 < pw["graph_seconds"] < pw["seconds"] and 0 < stats["graph_seconds"] < stats["seconds"]
    if stats["pool_bytes"] is not None:  # this torch's allocator snapshot names pools
        assert 0 < pw["pool_bytes"] <= stats["pool_bytes"]


@pytest.mark.gpu
def test_piecewise_replays_allocate_nothing_new(gpu_piecewise):
    """Steady state: piecewise replays of changing mixed steps leave memory_allocated unchanged
    (the pieces' outputs live in the pool; only the eager ops allocate, and free, per step)."""
    name, spec, _, runner = gpu_piecewise
    builder = ca.get_attn_backend(name, spec).get_builder_cls()(spec)
    per_req = GPU_MAX_LEN // spec.block_size
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(8)]
    gen = torch.Generator().manual_seed(0)

    def step(i: int) -> None:
        prompt = 8 + i % 50  # one prompt chunk + 3 decodes: 11 .. 60 tokens, buckets 16, 32, 64
        seq_lens, query_lens = [prompt, 20 + i % 7, 30, 41], [prompt, 1, 1, 1]
        md = builder.build(seq_lens, query_lens, tables[:4])
        ids = torch.randint(GPU_CONFIG.vocab_size, (md.num_tokens,), generator=gen).cuda()
        pos = torch.cat([torch.arange(prompt), torch.tensor(seq_lens[1:]) - 1]).cuda()
        runner.run(md, ids, pos)

    for i in range(60):
        step(i)
    gc.collect()  # earlier tests' garbage (one xdist worker runs many) must not be freed inside the window
    torch.cuda.synchronize()
    before, count = torch.cuda.memory_allocated(), runner.counts["piecewise"]
    # FlashInfer's wrappers keep the device tensors of the last plan in each of their two slots
    # (each step's fields share one buffer, its size the step's): the window ends on the step
    # shapes the warm-up ended on: i = 58, 59 (the shapes repeat every 350 steps)
    for i in range(60, 410):
        step(i)
    gc.collect()
    torch.cuda.synchronize()
    assert runner.counts["piecewise"] - count == 350
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
@pytest.mark.long(35)
@pytest.mark.parametrize("name", ["FLASHINFER", "TORCH_SDPA"])
def test_compiled_runner_with_piecewise_serves_greedy_tokens_like_eager(name):
    """CUDAGraphRunner(compile=True, piecewise=True, postprocess=argmax), what the bench runs:
    pieces compiled with COMPILE_OPTIONS and the argmax in the last piece; prefill and mixed
    steps (piecewise) and decodes (full graphs) give eager's greedy tokens."""
    spec = gpu_spec(name)
    backend = gpu_backend(name, spec)
    torch._dynamo.reset()
    model = build_model(GPU_CONFIG, seed=0, backend=name, dtype=torch.bfloat16, device="cuda")
    runner = CUDAGraphRunner(model, backend, spec, allocate_kv_caches(GPU_CONFIG, backend, spec),
                             capture_sizes=[1, 2, 4], max_batch_size=4, progress=False, compile=True,
                             postprocess=lambda logits: logits.argmax(-1), piecewise=True, piecewise_sizes=[16, 64])
    runner.capture()
    ref = Engine(spec, direct(model, allocate_kv_caches(GPU_CONFIG, backend, spec)), backend_name=name)
    eng = Engine(spec, runner.run, backend_name=name)

    def next_step(i: int, step: dict) -> dict:  # after steps 2 and 5 a new prompt joins: a mixed step
        return {**prompts(1, seed=60 + i, vocab=GPU_CONFIG.vocab_size), **step} if i in (2, 5) else step

    assert greedy_agreement(ref, eng, prompts(2, seed=6, vocab=GPU_CONFIG.vocab_size), 10, next_step) >= 0.9
    assert runner.counts["piecewise"] == 3 and runner.counts["graph"] == 7


def test_piecewise_routing_without_the_token_count_is_refused():
    with pytest.raises(ValueError, match="num_tokens"):
        choose_path(num_prefills=1, num_seqs=2, max_seq_len=40, largest_size=16, max_seq_len_to_capture=64,
                    largest_piecewise_tokens=64)


def test_op_groups_keep_their_layers_alive_so_replaced_layers_get_new_names():
    """The op groups run without Dynamo's guards and hold the layer names they were traced with.
    A dead layer's name goes to the next layer of its kind, so the groups keep their layers'
    records alive: layers that replace the model's after capture get names of their own."""
    torch._dynamo.reset()
    spec = cpu_spec()
    model = build_model(TINY, seed=0, backend="TORCH_SDPA")
    runner = piecewise_runner(model, ca.get_attn_backend("TORCH_SDPA"), spec, random_caches(spec, 0))
    old = {layer.attn.layer_name: weakref.ref(layer.attn._call) for layer in model.layers}  # the test holds none
    for layer in model.layers:
        attn = layer.attn
        layer.attn = None  # the old module goes before its replacement is made
        del attn
        layer.attn = ca.Attention(TINY.num_heads, TINY.head_size, TINY.head_size**-0.5,
                                  num_kv_heads=TINY.num_kv_heads, backend="TORCH_SDPA")
    assert not {layer.attn.layer_name for layer in model.layers} & set(old)
    assert all(record() is not None and get_layer(name) is record() for name, record in old.items())
    assert runner.piecewise is not None  # the runner, and its op groups, still alive here

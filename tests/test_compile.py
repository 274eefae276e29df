"""The compiled path on CPU: one graph, no breaks, no recompiles, cache write reinplaced."""

from __future__ import annotations

import re

import pytest
import torch
from expecttest import TestCase
from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs, normalize_gm
from torch._dynamo.utils import ReinplaceCounters, counters
from torch._inductor.utils import run_and_get_code

import compiled_attn as ca
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model
from compiled_attn.paging import BlockAllocator, Request, schedule
from compiled_attn.registry import BACKEND_CLASSES

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)
BLOCK_SIZE, NUM_BLOCKS = 4, 96
# Batch mixes: (new prompt lengths, decode context lengths). The third is a single-token batch,
# which Dynamo would specialise on without ca.mark_token_dim.
MIXES = [
    ([7, 3], []),
    ([5], [9, 4, 12]),
    ([], [6]),
    ([1], []),
    ([], [3, 8, 2, 17, 5]),
    ([2, 11, 4], [10]),
]


def normalize(graph: str) -> str:
    """Graph text without the per-process parts: layer-name counters."""
    return re.sub(r"'(\w+Impl\.\w+)\.\d+'", r"'\1.N'", graph)


CPU_SPEC = TINY.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32, device="cpu")


def step_inputs(mix, seed: int, spec: ca.AttentionSpec = CPU_SPEC, backend: str = "TORCH_SDPA"):
    """(metadata, input_ids, positions) for one batch mix: decodes get random past tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts, contexts = mix
    reqs = [Request(tokens=torch.randint(TINY.vocab_size, (n,), generator=g).tolist()) for n in prompts]
    for n in contexts:
        tokens = torch.randint(TINY.vocab_size, (n + 1,), generator=g).tolist()
        reqs.append(Request(tokens=tokens, num_computed=n))
    allocator = BlockAllocator(spec.num_blocks, spec.block_size)
    seq_lens, query_lens, tables, ids, pos = schedule(reqs, allocator, spec.device)
    md = ca.get_attn_backend(backend).get_builder_cls()(spec).build(seq_lens, query_lens, tables)
    ca.mark_token_dim(ids, pos)
    return md, ids, pos


def random_caches(seed: int, spec: ca.AttentionSpec = CPU_SPEC) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    caches = allocate_kv_caches(TINY, ca.get_attn_backend("TORCH_SDPA"), spec)  # one cache shape for all backends
    return [c.normal_() for c in caches]


@pytest.fixture(scope="module")
def model():
    return build_model(TINY, seed=0, backend="TORCH_SDPA")


def test_model_traces_to_one_graph_without_breaks(cpu_backend):
    name = cpu_backend.get_name()
    model = build_model(TINY, seed=0, backend=name)
    md, ids, pos = step_inputs(MIXES[1], seed=0, backend=name)
    with ca.set_forward_context(md):
        explained = torch._dynamo.explain(model)(ids, pos, random_caches(0))
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1


def test_batch_mixes_compile_once_and_match_eager(cpu_backend):
    name = cpu_backend.get_name()
    model = build_model(TINY, seed=0, backend=name)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for i, mix in enumerate(MIXES):
        md, ids, pos = step_inputs(mix, seed=i, backend=name)
        eager_caches, compiled_caches = random_caches(i), random_caches(i)
        with ca.set_forward_context(md):
            want = model(ids, pos, eager_caches)
            got = compiled(ids, pos, compiled_caches)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(compiled_caches, eager_caches, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # K/V come from fused rope math
        if i == 0:
            first = counter.frame_count
    assert counter.frame_count == first, f"{counter.frame_count - first} recompiles over {len(MIXES)} batch mixes"
    model_graphs = [g for g in counter.graphs if len(g.graph.nodes)]  # inductor may trace an empty helper frame
    assert len(model_graphs) == 1


def test_inductor_writes_the_cache_in_place(model):
    torch._dynamo.reset()
    counters.clear()
    ReinplaceCounters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    md, ids, pos = step_inputs(MIXES[1], seed=3)
    caches = random_caches(3)
    with ca.set_forward_context(md):
        _, (code, *_) = run_and_get_code(compiled, ids, pos, caches)
    # the op is called on the cache argument itself: no clone before it, no copy back after
    assert re.search(r"compiled_attn\.kv_cache_update\.default\([^\n]*, arg\d+_1, '", code), code
    assert "copy_" not in code and "clone" not in code, code
    assert ReinplaceCounters.get_total_missed() == 0
    assert counters["inductor"]["extern_calls"] >= 2  # our two ops per layer run as extern calls


def test_both_ops_read_one_copy_of_q_k_v():
    """The cache write and the attention op read the same q and k buffers, and v as a view of the
    QKV projection. Under Inductor's default for custom ops (exact strides) each op got its own
    copy of every input that is a view of a result not yet stored: in bf16 the rotated q and k
    were stored twice, as on CUDA, where v was copied twice too (the ops are `flexible_layout`)."""
    spec = TINY.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.bfloat16, device="cpu")
    model = build_model(TINY, seed=0, backend="TORCH_SDPA", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    md, ids, pos = step_inputs(MIXES[1], seed=3, spec=spec)
    # no cached code: the cache's key does not include the ops' tags, which this test is about
    with ca.set_forward_context(md), torch._inductor.config.patch(force_disable_caches=True):
        _, (code, *_) = run_and_get_code(compiled, ids, pos, random_caches(3, spec))
    calls = dict(re.findall(r"torch\.ops\.compiled_attn\.(\w+)\.default\((.*)\)", code))
    write, attend = (calls[op].split(", ") for op in ("kv_cache_update", "torch_sdpa_attention"))
    assert write[:2] == attend[:2] and write[0].startswith("buf"), code  # q, k: one buffer each
    v = ", ".join(write[2:-2])  # reinterpret_tensor(buf, sizes, strides, offset)
    assert v.startswith("reinterpret_tensor(buf") and v in ", ".join(attend), code


class TestGraphs(TestCase):
    def test_attention_layer_graph(self):
        torch._dynamo.reset()
        layer = ca.Attention(4, 16, 0.25, num_kv_heads=2, backend="TORCH_SDPA")
        spec = ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, block_size=4, num_blocks=8,
                                dtype=torch.float32, device="cpu")
        md = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(spec).build([5, 3], [5, 1], [[0, 1], [2]])
        q, k, v = torch.randn(6, 64), torch.randn(6, 32), torch.randn(6, 32)
        cache = torch.randn(2, 8, 4, 2, 16)
        backend = EagerAndRecordGraphs()
        with ca.set_forward_context(md):
            torch.compile(layer, backend=backend, fullgraph=True, dynamic=True)(q, k, v, cache)
        self.assertEqual(len(backend.graphs), 1)
        graph = normalize(normalize_gm(backend.graphs[0].print_readable(print_output=False)))
        self.assertExpectedInline(graph, """\
class GraphModule(torch.nn.Module):
    def forward(self, s5: "Sym(s5)", L_query_: "f32[s5, 64]", L_key_: "f32[s5, 32]", L_value_: "f32[s5, 32]", s28: "Sym(s28)", s43: "Sym(s43)", L_kv_cache_: "f32[2, s28, s43, 2, 16]"):
        l_query_ = L_query_
        l_key_ = L_key_
        l_value_ = L_value_
        l_kv_cache_ = L_kv_cache_

        size_4 = l_kv_cache_.size()
        getitem_14: "Sym(2)" = size_4[3]
        getitem_15: "Sym(16)" = size_4[4];  size_4 = None
        eq: "Sym(True)" = getitem_14 == 2;  getitem_14 = None
        eq_1: "Sym(True)" = getitem_15 == 16;  getitem_15 = None
        and_: "Sym(True)" = eq & eq_1;  eq = eq_1 = None
        not_ = _operator_not_(and_);  and_ = not_ = None

        q: "f32[s5, 4, 16]" = l_query_.view(s5, 4, 16);  l_query_ = None

        k: "f32[s5, 2, 16]" = l_key_.view(-1, 2, 16);  l_key_ = None

        v: "f32[s5, 2, 16]" = l_value_.view(-1, 2, 16);  l_value_ = None

        output: "f32[s5, 4, 16]" = torch.empty_like(q)

        kv_cache_update = torch.ops.compiled_attn.kv_cache_update(q, k, v, l_kv_cache_, 'TorchSDPAImpl.decoder.N');  kv_cache_update = None

        torch_sdpa_attention = torch.ops.compiled_attn.torch_sdpa_attention(q, k, v, l_kv_cache_, output, 'TorchSDPAImpl.decoder.N');  q = k = v = l_kv_cache_ = torch_sdpa_attention = None

        view_3: "f32[s5, 64]" = output.view(s5, 64);  output = s5 = None
        return (view_3,)
""")


def test_context_reading_ops_are_cudagraph_unsafe(contract_backend):
    # reduce-overhead's CUDA graphs copy only graph inputs: a captured op reading the forward
    # context would replay stale metadata, so Inductor must split its graphs around these ops
    for op in (torch.ops.compiled_attn.kv_cache_update, contract_backend.attention_op):
        assert torch.Tag.cudagraph_unsafe in op.default.tags


@pytest.mark.parametrize("op", ["copy_blocks", "swap_blocks"])
def test_block_ops_may_be_captured(op):
    assert torch.Tag.cudagraph_unsafe not in getattr(torch.ops.compiled_attn, op).default.tags


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BACKEND_CLASSES()))
def test_batch_mixes_compile_once_on_cuda(name):
    """Each backend's op on the device: one graph, no breaks, no recompiles over the batch mixes."""
    backend = BACKEND_CLASSES()[name]
    if backend.unavailable_reason() is not None:
        pytest.skip(f"{name}: {backend.unavailable_reason()}")
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2)  # head size 64: every backend takes it
    block_size = next(b for b in (16, 64) if backend.supports_block_size(b))
    spec = config.attention_spec(block_size=block_size, num_blocks=64, dtype=torch.bfloat16, device="cuda")
    model = build_model(config, seed=0, backend=name, dtype=torch.bfloat16, device="cuda")
    md, ids, pos = step_inputs(MIXES[1], seed=0, spec=spec, backend=name)
    with ca.set_forward_context(md):
        explained = torch._dynamo.explain(model)(ids, pos, allocate_kv_caches(config, backend, spec))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for i, mix in enumerate(MIXES):
        md, ids, pos = step_inputs(mix, seed=i, spec=spec, backend=name)
        caches = [c.normal_() for c in allocate_kv_caches(config, backend, spec)]
        eager_caches = [c.clone() for c in caches]
        with ca.set_forward_context(md):
            want = model(ids, pos, eager_caches)
            got = compiled(ids, pos, caches)
        assert ((got - want).norm() / want.norm()).item() < 2e-2
        if i == 0:
            first = counter.frame_count
    assert counter.frame_count == first, f"{counter.frame_count - first} recompiles over {len(MIXES)} batch mixes"

"""The forward context is per thread and per asyncio task, and restored on every exit path.

Two models served from one process on two threads (or two asyncio tasks) step in lock-step, each
inside its own `set_forward_context` while the other is inside its own: each reads only its own
metadata, writes only its own caches (checked byte for byte against single-threaded runs) and
gets the single-threaded outputs; no context is left set afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import threading

import pytest
import torch

import compiled_attn as ca
from compiled_attn.forward_context import LayerCall, get_layer, register_layer
from compiled_attn.models.llama import LlamaConfig, build_model

SDPA = ca.get_attn_backend("TORCH_SDPA")
TINY = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
BS, NB = 4, 24


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def no_context() -> bool:
    try:
        ca.get_forward_context()
    except RuntimeError:
        return True
    return False


@dataclasses.dataclass
class Server:
    """One model with its own caches, builder and a deterministic stream of prefill steps."""

    seed: int
    model: torch.nn.Module = None
    caches: list[torch.Tensor] = None
    outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.spec = TINY.attention_spec(block_size=BS, num_blocks=NB, dtype=torch.float32, device="cpu")
        self.model = build_model(TINY, seed=self.seed, backend="TORCH_SDPA")
        self.builder = SDPA.get_builder_cls()(self.spec)
        shape = SDPA.get_kv_cache_shape(NB, BS, TINY.num_kv_heads, TINY.head_size)
        self.caches = [torch.full(shape, float("nan")) for _ in range(TINY.num_layers)]

    def step_inputs(self, step: int):
        """Fresh prompts on random distinct blocks: each step writes, then reads, its own tokens."""
        rng = random.Random(self.seed * 100_003 + step)
        lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
        blocks = rng.sample(range(NB), NB)
        tables, at = [], 0
        for n in lens:
            tables.append(blocks[at : at + -(-n // BS)])
            at += len(tables[-1])
        md = self.builder.build(lens, lens, tables)
        ids = torch.tensor([rng.randrange(TINY.vocab_size) for _ in range(sum(lens))])
        positions = torch.cat([torch.arange(n) for n in lens])
        return md, ids, positions

    def run(self, md, ids, positions) -> None:
        self.outputs.append(self.model(ids, positions, self.caches))


def single_threaded(seed: int, steps: int) -> Server:
    server = Server(seed)
    for step in range(steps):
        md, ids, pos = server.step_inputs(step)
        with ca.set_forward_context(md):
            server.run(md, ids, pos)
    return server


def assert_same_as_single_threaded(servers: list[Server], steps: int) -> None:
    for server in servers:
        alone = single_threaded(server.seed, steps)
        assert len(server.outputs) == steps
        assert all(torch.equal(a, b) for a, b in zip(server.outputs, alone.outputs, strict=True)), \
            f"server {server.seed}: outputs differ from its single-threaded run"
        assert all(same_bits(a, b) for a, b in zip(server.caches, alone.caches, strict=True)), \
            f"server {server.seed}: its caches differ from its single-threaded run (a cross-write)"


@pytest.fixture
def quick_switches():
    """One intra-op thread and a short GIL switch interval: two Python threads of tiny models
    otherwise spend most of a lock-step in oversubscribed thread pools and 5 ms GIL waits."""
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)
    sys.setswitchinterval(5e-4)
    yield
    torch.set_num_threads(threads)
    sys.setswitchinterval(interval)


def test_two_threads_serving_two_models_never_read_each_others_metadata(quick_switches):
    steps = 1000
    servers = [Server(1), Server(2)]
    # both threads are inside their own context when either runs its model
    inside = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []
    left_set: list[bool] = []

    def serve(server: Server) -> None:
        try:
            for step in range(steps):
                md, ids, pos = server.step_inputs(step)
                with ca.set_forward_context(md):
                    inside.wait()
                    server.run(md, ids, pos)
                    inside.wait()
            left_set.append(not no_context())
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            inside.abort()

    threads = [threading.Thread(target=serve, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert left_set == [False, False], "a thread still saw a forward context after its block"
    assert no_context(), "a forward context leaked into the main thread"
    assert_same_as_single_threaded(servers, steps)


def test_two_asyncio_tasks_see_their_own_context():
    steps = 50
    servers = [Server(3), Server(4)]

    async def serve(server: Server) -> None:
        for step in range(steps):
            md, ids, pos = server.step_inputs(step)
            with ca.set_forward_context(md):
                await asyncio.sleep(0)  # the other task enters its own context here
                server.run(md, ids, pos)
                await asyncio.sleep(0)
        assert no_context()

    async def main() -> None:
        await asyncio.gather(*(serve(s) for s in servers))

    asyncio.run(main())
    assert no_context()
    assert_same_as_single_threaded(servers, steps)


def test_compiled_layer_shared_by_two_threads_reads_each_threads_metadata(quick_switches):
    # one compiled graph, two threads with their own metadata and caches: the ops read the
    # context at run time, in the calling thread
    torch._dynamo.reset()
    spec = ca.AttentionSpec(num_heads=2, num_kv_heads=1, head_size=8, block_size=BS, num_blocks=NB,
                            dtype=torch.float32, device="cpu")
    layer = ca.Attention(2, 8, 8**-0.5, num_kv_heads=1, backend="TORCH_SDPA")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    builder = SDPA.get_builder_cls()(spec)
    shape = SDPA.get_kv_cache_shape(NB, BS, 1, 8)

    def inputs(seed: int):
        g = torch.Generator().manual_seed(seed)
        n = 3 + seed % 5
        md = builder.build([n], [n], [[seed % 6, 6 + seed % 6]])
        return md, torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)

    def serve(seed: int, fn, cache, outs, barrier) -> None:
        for step in range(20):
            md, q, k, v = inputs(seed * 1000 + step)
            with ca.set_forward_context(md):
                if barrier is not None:
                    barrier.wait()
                outs.append(fn(q, k, v, cache))

    caches = {s: torch.full(shape, float("nan")) for s in (1, 2)}
    outs: dict[int, list] = {1: [], 2: []}
    barrier = threading.Barrier(2, timeout=60)
    with ca.set_forward_context(inputs(0)[0]):  # compile once, outside the threads
        md0, q0, k0, v0 = inputs(0)
        compiled(q0, k0, v0, torch.full(shape, float("nan")))
    threads = [threading.Thread(target=serve, args=(s, compiled, caches[s], outs[s], barrier)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in (1, 2):
        alone_cache, alone = torch.full(shape, float("nan")), []
        serve(s, layer, alone_cache, alone, None)
        assert len(outs[s]) == 20
        torch.testing.assert_close(torch.cat(outs[s]), torch.cat(alone), rtol=1e-5, atol=1e-5)
        assert same_bits(caches[s], alone_cache)
    assert no_context()


@pytest.mark.parametrize("exit_by", ["return", "exception"])
def test_context_is_restored_on_every_exit(exit_by):
    md = SDPA.get_builder_cls()(
        ca.AttentionSpec(num_heads=2, num_kv_heads=1, head_size=8, block_size=BS, num_blocks=NB,
                         dtype=torch.float32, device="cpu")).build([3], [3], [[0]])
    outer = dataclasses.replace(md)
    with ca.set_forward_context(outer):
        try:
            with ca.set_forward_context(md):
                assert ca.get_forward_context().attn_metadata is md
                if exit_by == "exception":
                    raise KeyError("boom")
        except KeyError:
            pass
        assert ca.get_forward_context().attn_metadata is outer
    assert no_context()


@pytest.mark.parametrize("bad", [None, "metadata", torch.zeros(3)], ids=["none", "str", "tensor"])
def test_a_context_of_something_else_than_metadata_raises_and_sets_none(bad):
    match = "set_forward_context needs AttentionMetadata from a builder"
    with pytest.raises(ValueError, match=match), ca.set_forward_context(bad):
        pass
    assert no_context()


def test_derived_is_made_once_per_context_and_again_in_the_next():
    md = SDPA.get_builder_cls()(
        ca.AttentionSpec(num_heads=2, num_kv_heads=1, head_size=8, block_size=BS, num_blocks=NB,
                         dtype=torch.float32, device="cpu")).build([3], [3], [[0]])
    made = []

    def make() -> torch.Tensor:
        made.append(torch.randn(4))
        return made[-1]

    with ca.set_forward_context(md) as first:
        a, b = first.derived("k", make), first.derived("k", make)
        other = first.derived("other", make)
    with ca.set_forward_context(md) as second:
        c = second.derived("k", make)
    assert a is b and len(made) == 3  # "k" once per context, "other" once
    assert other is made[1] and c is made[2] and not torch.equal(a, c)


class StableNamesProbeImpl:
    """A stand-in impl: only its class name enters the layer names, a prefix no other test uses."""


def test_layer_names_take_the_lowest_id_free_among_live_layers():
    """A name is unique among live layers, and a dead layer's id goes to the next layer of its
    kind: a model built after others were dropped gets the names a fresh process gives it (the
    names are constants in compiled graphs, which Inductor's caches key on)."""
    def layer() -> LayerCall:
        return LayerCall(StableNamesProbeImpl(), 1.0, 1.0, ca.AttentionType.DECODER)

    calls = [layer() for _ in range(3)]
    names = [register_layer(c) for c in calls]
    assert names == [f"StableNamesProbeImpl.decoder.{i}" for i in range(3)]
    del calls[:2]  # ids 0 and 1 die with their records
    with pytest.raises(RuntimeError, match="is alive"):
        get_layer(names[0])
    later = [layer() for _ in range(3)]
    assert [register_layer(c) for c in later] == [f"StableNamesProbeImpl.decoder.{i}" for i in (0, 1, 3)]
    assert get_layer(names[0]) is later[0] and get_layer(names[2]) is calls[0]


@pytest.mark.parametrize("copy_by", ["deepcopy", "pickle"])
def test_a_copied_layer_runs_its_own_options_once_its_original_is_gone(copy_by):
    """A copy carried its original's layer name: once the original died and a new layer took the
    name, the copy's ops ran the new layer's options (here: no window) without a word."""
    import copy
    import gc
    import pickle

    from reference import reference_attention

    h, kv, d, block = 2, 1, 8, 4
    spec = ca.AttentionSpec(num_heads=h, num_kv_heads=kv, head_size=d, block_size=block, num_blocks=16,
                            dtype=torch.float32, device="cpu")
    md = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(spec).build([12], [12], [[0, 1, 2]])
    q, k, v = torch.randn(12, h * d), torch.randn(12, kv * d), torch.randn(12, kv * d)
    original = ca.Attention(h, d, d**-0.5, num_kv_heads=kv, sliding_window=2, backend="TORCH_SDPA")
    layer = copy.deepcopy(original) if copy_by == "deepcopy" else pickle.loads(pickle.dumps(original))
    del original
    gc.collect()
    taker = ca.Attention(h, d, d**-0.5, num_kv_heads=kv, backend="TORCH_SDPA")  # the freed name's next holder
    with ca.set_forward_context(md):
        out = layer(q, k, v, torch.zeros(2, 16, block, kv, d))
        taker(q, k, v, torch.zeros(2, 16, block, kv, d))
    want = reference_attention(q.view(12, h, d).double(), k.view(12, kv, d).double(), v.view(12, kv, d).double(),
                               torch.arange(12), causal=True, scale=d**-0.5, sliding_window=2)
    torch.testing.assert_close(out.view(12, h, d).double(), want, rtol=1e-5, atol=1e-5)

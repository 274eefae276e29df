"""Tensor parallelism: the sharded reference model equals the unsharded one, compiles to one
graph per rank, and refuses bad layouts with clear errors.

CPU: pure layout rules in this process; two gloo ranks (spawned once for the module, ~30 s on
two cores) run every distributed check and send back what they saw, which the tests assert.
Compiled checks use Inductor (it lowers the functional collectives to gloo calls on CPU).
GPU (two cards, NCCL): the 8B-shaped model at TP=2 in bf16, captured CUDA graphs vs eager.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import compiled_attn as ca
from compiled_attn import distributed
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.models import tp as tpm
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model
from compiled_attn.paging import BlockAllocator, Request, last_token_rows, schedule

SDPA = "TORCH_SDPA"
TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
MQA = dataclasses.replace(TINY, num_kv_heads=1)  # one KV head: replicated on both ranks
BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 4, 128, 64
DECODE_STEPS = 5
WORLD = 2

Step = Callable[[ca.AttentionMetadata, torch.Tensor, torch.Tensor], torch.Tensor]

# -------------------------------------------------------------------------------------------
# Layout rules (this process)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tp_size", "local"),
    [(32, 8, 1, (32, 8)), (32, 8, 2, (16, 4)), (32, 8, 8, (4, 1)), (16, 4, 8, (2, 1)), (8, 1, 2, (4, 1))],
)
def test_local_head_counts(num_heads, num_kv_heads, tp_size, local):
    assert tpm.local_head_counts(num_heads, num_kv_heads, tp_size) == local


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "tp_size", "match"),
    [(6, 2, 4, "num_heads=6"), (8, 6, 4, "num_kv_heads=6"), (12, 2, 3, "multiple of num_kv_heads"), (8, 2, 0, ">= 1"),
     (8, 2, True, "^tp_size must be an int, got True$"), (8, 2, 2.0, "^tp_size must be an int, got 2.0$"),
     (8, 0, 2, "^num_kv_heads must be >= 1, got 0$")],
)
def test_heads_that_do_not_split_raise(num_heads, num_kv_heads, tp_size, match):
    with pytest.raises(ValueError, match=match):
        tpm.local_head_counts(num_heads, num_kv_heads, tp_size)


@pytest.mark.parametrize(("num_kv_heads", "tp_size"), [(8, 2), (2, 4), (1, 4), (4, 8), (8, 8)])
def test_each_rank_holds_the_kv_heads_its_query_heads_use(num_kv_heads, tp_size):
    num_heads = 32
    group = num_heads // num_kv_heads  # query heads per KV head in the full model
    q_local, kv_local = tpm.local_head_counts(num_heads, num_kv_heads, tp_size)
    for rank in range(tp_size):
        first = tpm.first_kv_head(num_kv_heads, tpm.TPLayout(rank, tp_size, "g"))
        needed = {h // group for h in range(rank * q_local, (rank + 1) * q_local)}
        assert needed == set(range(first, first + kv_local))


def test_spec_holds_one_ranks_heads():
    spec = LlamaConfig.llama3_8b().attention_spec(block_size=16, num_blocks=8, dtype=torch.bfloat16, device="cpu",
                                                  tp_size=2)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_size) == (16, 4, 128)


def test_model_with_indivisible_intermediate_size_raises():
    config = dataclasses.replace(TINY, intermediate_size=129)
    with pytest.raises(ValueError, match="intermediate_size=129"):
        build_model_for_layout(config, tpm.TPLayout(0, 2, "g"))


def test_capture_size_check_without_a_group_is_a_no_op():
    distributed.check_capture_sizes_agree([4, 2, 1], None)


def never_run(group, device):
    raise AssertionError("a rank ran")


def test_run_ranks_refuses_a_world_it_cannot_make_before_spawning(monkeypatch):
    monkeypatch.setattr(distributed.mp, "start_processes", lambda *a, **k: pytest.fail("a rank was spawned"))
    for bad, error in ((0, "world_size must be >= 1, got 0"), (True, "world_size must be an int, got True"),
                       (2.0, "world_size must be an int, got 2.0")):
        with pytest.raises(ValueError, match=f"^{error}$"):
            distributed.run_ranks(never_run, bad, device_type="cpu")
    n = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"{n} ranks on CUDA need {n} GPUs, found {n - 1}"):
        distributed.run_ranks(never_run, n, device_type="cuda")
    for device_type in ("cuda:0", "CUDA", "gpu"):  # not run on the CPU in its stead
        with pytest.raises(ValueError, match=rf"^device_type must be 'cuda' or 'cpu' .*got '{device_type}'$"):
            distributed.run_ranks(never_run, 1, device_type=device_type)


def build_model_for_layout(config: LlamaConfig, tp: tpm.TPLayout):
    """Decoder layers for a layout without a process group (layout checks only)."""
    from compiled_attn.models.llama import DecoderLayer

    with torch.device("meta"):
        return DecoderLayer(config, SDPA, tp)


# -------------------------------------------------------------------------------------------
# Two gloo ranks


def prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def serve(step: Step, spec: ca.AttentionSpec, prompt_tokens: list[list[int]], forced: list[list[int]] | None,
          backend: str = SDPA) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill then DECODE_STEPS decodes through `step(md, ids, pos)`; feeds `forced` tokens if
    given (teacher forcing), else greedy ones. Returns (last-token logits per step, tokens fed)."""
    builder = ca.get_attn_backend(backend).get_builder_cls()(spec)
    allocator = BlockAllocator(spec.num_blocks, spec.block_size)
    reqs = [Request(tokens=list(p)) for p in prompt_tokens]
    logits_per_step, fed = [], []
    for i in range(DECODE_STEPS + 1):
        seq_lens, query_lens, tables, ids, pos = schedule(reqs, allocator, spec.device)
        md = builder.build(seq_lens, query_lens, tables)
        logits = step(md, ids, pos)[last_token_rows(query_lens)].float().cpu()
        tokens = forced[i] if forced is not None else logits.argmax(-1).tolist()
        for r, t in zip(reqs, tokens, strict=True):
            r.num_computed = len(r.tokens)
            r.tokens.append(t)
        logits_per_step.append(logits)
        fed.append(tokens)
    return logits_per_step, fed


def direct(model: torch.nn.Module, caches: list[torch.Tensor]) -> Step:
    def step(md, ids, pos):
        ca.mark_token_dim(ids, pos)
        with ca.set_forward_context(md):
            return model(ids, pos, caches)
    return step


def caches_for(config: LlamaConfig, spec: ca.AttentionSpec) -> list[torch.Tensor]:
    # NaN in every slot: a pad or an unused slot read by mistake would show
    return [c.fill_(float("nan")) for c in allocate_kv_caches(config, ca.get_attn_backend(SDPA), spec)]


def spec_for(config: LlamaConfig, tp_size: int, device: torch.device) -> ca.AttentionSpec:
    return config.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32, device=device,
                                 tp_size=tp_size, max_seq_len_to_capture=MAX_LEN)


def gloo_rank_checks(group: dist.ProcessGroup, device: torch.device) -> dict:
    """Everything the CPU tests assert, run on one gloo rank; returns plain data."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    out: dict = {"rank": rank}
    batch = prompts(4, seed=0, vocab=TINY.vocab_size)
    for label, config in (("gqa", TINY), ("mqa", MQA)):
        full_spec, spec = spec_for(config, 1, device), spec_for(config, size, device)
        full = build_model(config, seed=0, backend=SDPA)
        want, tokens = serve(direct(full, caches_for(config, full_spec)), full_spec, batch, None)
        shard = build_model(config, seed=0, backend=SDPA, tp_group=group)
        caches = caches_for(config, spec)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, _ = serve(direct(shard, caches), spec, batch, tokens)
        out[label] = {"want": want, "got": got, "heads": (spec.num_heads, spec.num_kv_heads),
                      "cache_shape": tuple(caches[0].shape),
                      "deprecated": [str(w.message) for w in caught  # the collectives' own warnings only
                                     if issubclass(w.category, DeprecationWarning | FutureWarning)
                                     and "_functional_collectives" in str(w.message)]}
    shard = build_model(TINY, seed=0, backend=SDPA, tp_group=group)
    spec = spec_for(TINY, size, device)

    md, ids, pos = mixed_step(spec)
    with ca.set_forward_context(md):
        explained = torch._dynamo.explain(shard)(ids, pos, caches_for(TINY, spec))
    out["explain"] = (explained.graph_break_count, explained.graph_count)

    torch._dynamo.reset()
    compiled = torch.compile(shard, fullgraph=True, dynamic=True)  # Inductor
    out["compiled"], _ = serve(direct(compiled, caches_for(TINY, spec)), spec, batch, tokens_of(out["gqa"]))

    # the runner's static-buffer step (no CUDA graphs on CPU) with the collectives in it
    runner = CUDAGraphRunner(shard, ca.get_attn_backend(SDPA), spec, caches_for(TINY, spec), use_cuda_graphs=False,
                             capture_sizes=[1, 2, 4, 8], max_batch_size=8, progress=False)
    distributed.capture_sharded(runner, group)
    out["runner_group"] = runner._group is group
    out["runner"], _ = serve(runner.run, spec, batch, tokens_of(out["gqa"]))
    # batch 1's pick on each rank: rank 1 alone would keep cublas
    out["slowest_rank_ms"] = distributed.slowest_rank_ms({"reductions": 4.0 + rank, "cublas": 6.0 - 3.0 * rank}, group)
    try:  # ranks that timed different candidates: every rank raises (none waits for the others)
        distributed.slowest_rank_ms({"reductions": 4.0, **({"cublas": 3.0} if rank == 0 else {})}, group)
    except RuntimeError as e:
        out["timed_error"] = str(e)
    # a candidate that failed to compile on rank 0 only: both ranks leave it out
    out["failed"] = distributed.failed_on_any_rank({"cublas": "OOM"} if rank == 0 else {}, group)
    out["runner_counts"] = dict(runner.counts)

    try:
        distributed.check_capture_sizes_agree([8, 4, 2, 1] if rank == 0 else [8, 4, 2], group)
    except ValueError as e:
        out["sizes_error"] = str(e)
    pw = CUDAGraphRunner(shard, ca.get_attn_backend(SDPA), spec, caches_for(TINY, spec), use_cuda_graphs=False,
                         capture_sizes=[], progress=False, piecewise=True, piecewise_sizes=[16, 8] if rank else [16],
                         piece_compiler="eager")
    try:  # the pieces hold the collectives too: different buckets would hang at replay
        distributed.capture_sharded(pw, group)
    except ValueError as e:
        out["buckets_error"] = str(e)
    wide = dataclasses.replace(spec, max_seq_len_to_capture=MAX_LEN * (1 + rank))  # another table width on rank 1
    widths = CUDAGraphRunner(shard, ca.get_attn_backend(SDPA), wide, caches_for(TINY, wide), use_cuda_graphs=False,
                             capture_sizes=[2, 1], max_batch_size=2, progress=False)
    try:  # a graph per size and width: other widths would pair different graphs' collectives
        distributed.capture_sharded(widths, group)
    except ValueError as e:
        out["widths_error"] = str(e)
    try:
        build_model(TINY, seed=0, backend=SDPA, device="cuda", tp_group=group)
    except ValueError as e:
        out["device_error"] = str(e)
    deeper = dataclasses.replace(TINY, num_layers=2 + rank)
    for what, kw in (("seed", dict(seed=rank)), ("config", dict(config=deeper))):
        try:  # another seed: no seed's model; another layer count: a hang at the extra layer's all-reduce
            build_model(**{"config": TINY, "seed": 0, **kw}, backend=SDPA, tp_group=group)
        except ValueError as e:
            out[f"build_{what}_error"] = str(e)
    # a group named per device type runs CPU collectives through gloo as a "gloo" group does
    per_type = dist.new_group(backend="cpu:gloo,cuda:gloo")
    tpm.check_group_device(per_type, "cpu")  # refused until the check read the backend per device type
    out["per_type_backends"] = (tpm.group_backend_for(per_type, "cpu"), tpm.group_backend_for(group, "cpu"))
    try:
        tpm.check_group_device(per_type, "cuda")
    except ValueError as e:
        out["per_type_cuda_error"] = str(e)
    return out


def mixed_step(spec: ca.AttentionSpec):
    """(metadata, input_ids, positions) of a step with two prefills and two decodes."""
    reqs = [Request(tokens=p) for p in prompts(2, seed=5, vocab=TINY.vocab_size)]
    reqs += [Request(tokens=p, num_computed=len(p) - 1) for p in prompts(2, seed=6, vocab=TINY.vocab_size)]
    seq_lens, query_lens, tables, ids, pos = schedule(reqs, BlockAllocator(NUM_BLOCKS, BLOCK_SIZE), spec.device)
    md = ca.get_attn_backend(SDPA).get_builder_cls()(spec).build(seq_lens, query_lens, tables)
    ca.mark_token_dim(ids, pos)
    return md, ids, pos


def tokens_of(result: dict) -> list[list[int]]:
    """The tokens the unsharded model chose (teacher forcing for every later run)."""
    return [logits.argmax(-1).tolist() for logits in result["want"]]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return distributed.run_ranks(gloo_rank_checks, WORLD, device_type="cpu")


@pytest.mark.parametrize("label", ["gqa", "mqa"])
def test_sharded_logits_equal_unsharded_over_prefill_and_decodes(ranks, label):
    for r in ranks:
        got, want = r[label]["got"], r[label]["want"]
        assert len(got) == DECODE_STEPS + 1
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # only the all-reduce order differs


def test_sharded_eager_forward_calls_no_deprecated_collective(ranks):
    # torch 2.13's functional all-gather warns under its old name at every eager call
    for r in ranks:
        for label in ("gqa", "mqa"):
            assert r[label]["deprecated"] == [], r[label]["deprecated"]


def test_ranks_return_identical_logits(ranks):
    for a, b in zip(ranks[0]["gqa"]["got"], ranks[1]["gqa"]["got"], strict=True):
        assert torch.equal(a, b)  # the all-gather hands every rank the same bits


@pytest.mark.parametrize(("label", "heads", "kv_heads"), [("gqa", 2, 1), ("mqa", 2, 1)])
def test_each_rank_holds_local_heads_and_caches(ranks, label, heads, kv_heads):
    for r in ranks:
        assert r[label]["heads"] == (heads, kv_heads)
        assert r[label]["cache_shape"] == (2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, TINY.head_size)


def test_sharded_model_traces_to_one_graph_without_breaks(ranks):
    for r in ranks:
        assert r["explain"] == (0, 1)


def test_compiled_sharded_model_matches_unsharded(ranks):
    for r in ranks:
        for g, w in zip(r["compiled"], r["gqa"]["want"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_runner_static_step_with_collectives_matches_unsharded(ranks):
    for r in ranks:
        for g, w in zip(r["runner"], r["gqa"]["want"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert r["runner_counts"]["graph"] == DECODE_STEPS


def test_batch_one_pick_goes_by_each_candidates_slowest_rank(ranks):
    """Every rank gets each candidate's slowest time (a step waits for the slowest rank at its
    collectives), so each keeps the same compile; ranks that timed different candidates all raise;
    a candidate that failed on one rank is left out on all; the sharded capture hands the runner
    its group."""
    assert [r["slowest_rank_ms"] for r in ranks] == [{"reductions": 5.0, "cublas": 6.0}] * WORLD
    assert all(r["runner_group"] for r in ranks)
    assert all("the ranks timed different batch-1 compiles (rank 0: ['cublas', 'reductions'], rank 1: "
               "['reductions'])" in r["timed_error"] for r in ranks)
    assert [r["failed"] for r in ranks] == [{"cublas": "OOM"}, {"cublas": "failed on rank 0: OOM"}]


def test_ranks_disagreeing_on_capture_sizes_raise_on_every_rank(ranks):
    for r in ranks:
        assert "ranks disagree" in r["sizes_error"] and "rank 1: [8, 4, 2]" in r["sizes_error"]
        assert "disagree on the piecewise buckets" in r["buckets_error"] and "rank 1: [16, 8]" in r["buckets_error"]
        assert "disagree on the decode graphs' block-table widths" in r["widths_error"]


def test_ranks_building_different_models_raise_on_every_rank(ranks):
    for r in ranks:
        for what in ("seed", "config"):
            assert r[f"build_{what}_error"].startswith("ranks disagree on the model (config, seed, backend, dtype")
            assert r[f"build_{what}_error"].endswith("; pass the same build_model arguments on all")


def test_gloo_group_for_a_cuda_model_raises(ranks):
    for r in ranks:
        assert "'gloo'" in r["device_error"] and "'nccl'" in r["device_error"]
        assert r["per_type_cuda_error"].startswith("the tensor-parallel group uses 'gloo' but the model is on cuda")


def test_a_group_with_a_backend_per_device_type_serves_a_cpu_model(ranks):
    """`init_process_group()` (torch's default) and "cpu:gloo,..." groups report "undefined" or
    the whole string from `get_backend`; the check reads the backend of the model's device type."""
    assert [r["per_type_backends"] for r in ranks] == [("gloo", "gloo")] * WORLD


# -------------------------------------------------------------------------------------------
# Two GPUs (NCCL): CUDA graphs with the all-reduces inside


def nccl_graphs_vs_eager(group: dist.ProcessGroup, device: torch.device, config: LlamaConfig,
                         compile_model: str) -> dict:
    """Teacher-forced bf16 logits: eager sharded model vs the runner's captured graphs; the model
    eager ("eager"), compiled by the caller ("caller") or by the runner ("runner": batch 1's pick
    of compile, agreed across the ranks)."""
    size = dist.get_world_size(group)
    spec = config.attention_spec(block_size=16, num_blocks=256, dtype=torch.bfloat16, device=device, tp_size=size,
                                 max_seq_len_to_capture=256)
    backend = ca.get_attn_backend(None, spec)
    model = build_model(config, seed=0, backend=backend.get_name(), dtype=torch.bfloat16, device=device,
                        tp_group=group, init_device=device)  # seconds, not minutes, for 8B
    batch = prompts(6, seed=1, vocab=config.vocab_size)
    caches = [c.normal_() for c in allocate_kv_caches(config, backend, spec)]
    name = backend.get_name()
    want, tokens = serve(direct(model, caches), spec, batch, None, name)
    step = torch.compile(model, fullgraph=True, dynamic=True) if compile_model == "caller" else model
    runner = CUDAGraphRunner(step, backend, spec, [c.normal_() for c in allocate_kv_caches(config, backend, spec)],
                             capture_sizes=[1, 4, 8], max_batch_size=8, progress=False,
                             compile=compile_model == "runner")
    distributed.capture_sharded(runner, group)
    got, _ = serve(runner.run, spec, batch, tokens, name)
    return {"want": want, "got": got, "counts": dict(runner.counts), "backend": name,
            "one_token": runner.capture_stats["one_token"]}


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
SMALL_GPU = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16,
                        num_kv_heads=4)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize(
    ("config", "compile_model"),
    [
        pytest.param(LlamaConfig.llama3_8b(), "eager", id="8b-eager-graphs"),
        pytest.param(SMALL_GPU, "caller", id="small-compiled-graphs"),
        pytest.param(SMALL_GPU, "runner", id="small-runner-compiled-graphs"),
    ],
)
def test_tp2_graphs_match_eager_in_bf16(config, compile_model):
    ranks = distributed.run_ranks(nccl_graphs_vs_eager, 2, config, compile_model, device_type="cuda")
    if compile_model == "runner":  # both ranks keep the compile their slowest rank's times chose
        picks = [r["one_token"] for r in ranks]
        assert picks[0]["slowest_rank_ms"] == picks[1]["slowest_rank_ms"]
        assert picks[0]["compile"] == picks[1]["compile"] == min(picks[0]["slowest_rank_ms"],
                                                                 key=picks[0]["slowest_rank_ms"].get)
    for r in ranks:
        assert r["counts"]["graph"] == DECODE_STEPS, r["counts"]
        for g, w in zip(r["got"], r["want"], strict=True):
            err = ((g - w).norm() / w.norm()).item()
            assert err <= 2e-2, f"{r['backend']}: graphed vs eager logits rel err {err:.2e}"

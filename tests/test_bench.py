"""CPU checks of the bench: result tables, plots, the profile reduction and the decode-loop peer's
fidelity (the timed suites themselves need CUDA)."""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import compiled_attn as ca
from compiled_attn.backends import flashinfer as fib
from compiled_attn.bench import decode_loop as dl
from compiled_attn.bench.compiles import compile_counts, compiles_line, counts_since, reset_dynamo
from compiled_attn.bench.decode_loop import PEER_INDUCTOR, GptFastDecoder, fresh_draws
from compiled_attn.bench.gaps import gap_table, host_during_gaps
from compiled_attn.bench.kernel_table import Kernel, per_layer_table
from compiled_attn.bench.piecewise_bench import QUICK_BUCKETS, STEPS, step_inputs
from compiled_attn.bench.plots import decode_series
from compiled_attn.bench.report import print_table
from compiled_attn.bench.suite import seconds_line, show_rows_as_measured
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model

TINY_LOOP = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)


def test_plots_draw_the_decode_grid_only():
    fi = "compiled_attn.bench.decode_flashinfer"
    xf = "compiled_attn.bench.decode_xformers"
    results = {
        fi: [
            {"suite": "decode_flashinfer", "impl": "ours (graph)", "batch": 8, "ctx": 512, "page": 16, "us": 12.0,
             "hbm_frac": 0.5},
            {"suite": "decode_flashinfer", "impl": "torch sdpa", "batch": 8, "ctx": 512, "page": None, "us": 9.0,
             "hbm_frac": 0.7},
            {"suite": "page_sweep_flashinfer", "impl": "ours (graph)", "batch": 8, "ctx": 1024, "page": 64,
             "us": 20.0, "hbm_frac": 0.6},
        ],
        xf: [
            {"suite": "decode_xformers", "variant": "ours", "batch": 8, "ctx": 512, "time_us": 11.0, "hbm_frac": 0.55},
            {"suite": "prefill_xformers", "variant": "fresh", "batch": 8, "ctx": 2048, "time_us": 1800.0},
        ],
    }
    assert decode_series(results) == {
        "FlashInfer: ours (graph)": [(8, 512, 12.0, 0.5)],
        "torch SDPA, static cache": [(8, 512, 9.0, 0.7)],
        "xFormers: ours": [(8, 512, 11.0, 0.55)],
    }


def test_table_has_a_column_for_every_key_of_any_row(capsys):
    print_table([{"ceiling": "amax", "GB/s": 2781.7}, {"ceiling": "matmul", "TFLOP/s": 777.26}])
    header, amax, matmul = capsys.readouterr().out.splitlines()
    assert header.split() == ["ceiling", "GB/s", "TFLOP/s"]
    assert amax.split() == ["amax", "2782"] and matmul.split() == ["matmul", "777.3"]  # blank where absent
    assert amax.index("2782") == header.index("GB/s") and matmul.index("777.3") == header.index("TFLOP/s")


def test_kernel_table_splits_layer_and_step_kernels():
    steps, layers, t, kernels = 2, 4, 0.0, []
    for _ in range(steps):
        for _ in range(layers):
            for name, dur in (("gemv", 5.0), ("attn", 3.0), ("attn", 1.0)):
                kernels.append(Kernel(name, t, t + dur))
                t += dur + 0.5  # a launch gap
        kernels.append(Kernel("lm_head", t, t + 20.0))
        t += 21.0
    table = per_layer_table(kernels, steps, layers)
    rows = {r["kernel"]: r for r in table["rows"]}
    assert rows["gemv"]["where"] == rows["attn"]["where"] == "layer" and rows["lm_head"]["where"] == "step"
    assert rows["attn"]["calls/step"] == 2 * layers and rows["attn"]["us/layer"] == 4.0
    assert table["us/layer"] == 9.0 and table["kernels/layer"] == 3
    assert table["kernel us/step"] == layers * 9.0 + 20.0
    span = kernels[-1].end_us - kernels[0].start_us
    assert abs(table["gpu busy"] - steps * (layers * 9.0 + 20.0) / span) < 1e-12


def test_kernel_table_counts_a_layer_kernel_split_over_several_names_as_layer_work():
    """Batch 1's Inductor graph names one layer reduction differently in some layers (here the
    first two layers' GEMV is `gemv_a`, the other two's `gemv_b`): both are layer work, and a
    layer's time is their sum per step over the layers (the multiple-of-layers rule filed both
    under per-step work and read 3 us a layer)."""
    steps, layers, t, kernels = 2, 4, 0.0, []
    for _ in range(steps):
        for i in range(layers):
            for name, dur in (("gemv_a" if i < 2 else "gemv_b", 5.0), ("attn", 3.0)):
                kernels.append(Kernel(name, t, t + dur))
                t += dur + 0.5
        kernels.append(Kernel("lm_head", t, t + 20.0))
        t += 21.0
    table = per_layer_table(kernels, steps, layers)
    rows = {r["kernel"]: r for r in table["rows"]}
    assert [rows[k]["where"] for k in ("gemv_a", "gemv_b", "attn", "lm_head")] == ["layer"] * 3 + ["step"]
    assert rows["gemv_a"]["us/layer"] == rows["gemv_b"]["us/layer"] == 2.5  # 10 us a step over 4 layers
    assert table["us/layer"] == 8.0 and table["kernels/layer"] == 2
    assert table["kernel us/step"] == layers * 8.0 + 20.0


def test_kernel_table_keeps_copies_per_step_and_one_layer_whole():
    """Copies that run several times a step are the step's (its metadata), not a layer's; with one
    layer (the probes' single-layer tables) every other kernel is that layer's."""
    steps, t, kernels = 2, 0.0, []
    for _ in range(steps):
        for name, dur in (("Memcpy HtoD (Pinned -> Device)", 1.0), ("Memcpy HtoD (Pinned -> Device)", 1.0),
                          ("gemv", 5.0), ("attn", 3.0)):
            kernels.append(Kernel(name, t, t + dur))
            t += dur + 0.5
    wheres = {r["kernel"]: r["where"] for r in per_layer_table(kernels, steps, 4)["rows"]}
    assert wheres["Memcpy HtoD (Pinned -> Device)"] == "step"
    one = per_layer_table(kernels, steps, 1)
    assert {r["kernel"]: r["where"] for r in one["rows"]} == {"Memcpy HtoD (Pinned -> Device)": "step",
                                                             "gemv": "layer", "attn": "layer"}
    assert one["us/layer"] == 8.0 and one["kernels/layer"] == 2


def test_gap_table_splits_a_steps_idle_time_by_its_sides_and_the_hosts_part():
    """Two steps of a graph, an eager kernel launched late, another graph: lead, tail and gaps sum
    with the busy time to the wall; a gap is host-bound for as long as its launch call outlasted
    the work before it."""
    def step(t0: float, corr: int) -> list[dict]:
        def x(cat, name, ts, dur, c=None):
            return {"ph": "X", "cat": cat, "name": name, "ts": t0 + ts, "dur": dur,
                    "args": {} if c is None else {"correlation": corr + c}}
        return [x("user_annotation", f"step {corr}", 0, 100),
                x("cuda_runtime", "cudaGraphLaunch", 1, 4, 0), x("kernel", "mm", 10, 10, 0),
                x("kernel", "norm", 21, 9, 0),
                x("cuda_runtime", "cudaLaunchKernel", 25, 10, 1), x("kernel", "attn", 40, 10, 1),
                x("cuda_runtime", "cudaGraphLaunch", 36, 2, 2), x("kernel", "mm", 52, 8, 2),
                x("gpu_user_annotation", "step", 0, 100)]
    table = gap_table(step(0.0, 0) + step(200.0, 10))
    assert table["steps"] == 2
    assert (table["wall us/step"], table["busy us/step"]) == (100, 37)
    assert (table["lead us/step"], table["gaps us/step"], table["tail us/step"]) == (10, 13, 40)
    assert [(r["from"], r["to"], r["gaps/step"], r["us/step"], r["host-bound us/step"]) for r in table["rows"]] == [
        ("graph", "attn", 1, 10, 5), ("attn", "graph", 1, 2, 0), ("graph", "graph, same launch", 1, 1, 0)]
    with pytest.raises(ValueError, match="record_function"):
        gap_table([e for e in step(0.0, 0) if e["cat"] != "user_annotation"])
    overlapping = step(0.0, 0) + [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy", "ts": 15.0, "dur": 10.0,
                                   "args": {}}]  # from inside mm over the 1 us gap into norm
    table = gap_table(overlapping)
    assert (table["busy us/step"], table["gaps us/step"]) == (38, 12)  # the union (10-30 us): none counted twice
    assert sum(table[f"{k} us/step"] for k in ("busy", "lead", "gaps", "tail")) == table["wall us/step"]
    frames = [{"ph": "X", "cat": "python_function", "name": name, "ts": 200.0 + ts, "dur": dur}
              for name, ts, dur in (("runner.run", 0, 100), ("plan", 26, 8), ("check", 31, 1))]
    assert host_during_gaps(step(0.0, 0) + step(200.0, 10) + frames, step=1, min_gap_us=5) == [
        "+0 us: 10 us idle before mm", "+30 us: 10 us idle before attn", "    +26 8 us plan"]


def test_gpt_fast_peer_decodes_like_the_paged_model():
    """The decode_loop peer (static contiguous cache, index writes, masked SDPA) computes our model."""
    torch.manual_seed(0)
    model = build_model(LlamaConfig(num_layers=2), seed=0, backend="TORCH_SDPA")
    batch, steps = 2, 6
    peer = GptFastDecoder(model, batch, max_len=steps + 2)
    backend = ca.get_attn_backend("TORCH_SDPA")
    spec = model.config.attention_spec(block_size=4, num_blocks=8, dtype=torch.float32, device="cpu")
    caches = [c.normal_() for c in allocate_kv_caches(model.config, backend, spec)]
    builder = backend.get_builder_cls()(spec)
    tables = [[5, 1], [0, 7]]
    tokens = torch.randint(model.config.vocab_size, (batch,))
    for pos in range(steps):
        with sdpa_kernel(SDPBackend.MATH):  # as the bench's peer loop runs it
            want = peer(tokens.view(batch, 1), torch.tensor([pos]))[:, 0]
        md = builder.build([pos + 1] * batch, [1] * batch, tables)
        with ca.set_forward_context(md):
            got = model(tokens, torch.full((batch,), pos), caches)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens = want.argmax(-1)


def test_overhead_rows_time_repeat_steps_against_the_raw_kernels(monkeypatch):
    """The overhead suite's op rows: the layer is checked in full once (its first call of the
    kind, which its two ops share); every timed call after that is a repeat step."""
    from compiled_attn import validation
    from compiled_attn.bench import overhead

    full_checks = []
    monkeypatch.setattr(validation, "check_step", lambda *args: full_checks.append(args))
    rows = overhead.backend_rows("TORCH_SDPA", ca.get_attn_backend("TORCH_SDPA"), "cpu", iters=2)
    ops = [r["what"].split(" (")[0] for r in rows]
    assert ops == ["TORCH_SDPA: kv_cache_update", "TORCH_SDPA: torch_sdpa_attention"]
    assert all(r["checks us"] > 0 and "overhead us" in r and "op group overhead us" in r for r in rows)
    assert all("pipelined overhead us" in r and "pipelined op group overhead us" in r for r in rows)
    assert len(full_checks) == 1  # the attention op's first call; the cache write is of its kind


def test_paired_pipelined_overhead_finds_a_known_cost_and_patches_only_the_raw_call(monkeypatch):
    """The overhead estimator on a call that costs the raw call's 100 us plus 200 (a fake clock
    the calls advance, so that no load on the machine can move it): it reads 200 us, not the
    call's 300, and its raw context (entered again each round, as the suite's `mock.patch` is)
    applies to the raw call only."""
    from compiled_attn.bench import overhead, timing

    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Patch:
        active = False

        def __enter__(self):
            Patch.active = True

        def __exit__(self, *exc):
            Patch.active = False

    raw_saw = []

    def raw() -> None:
        raw_saw.append(Patch.active)
        now[0] += 100e-6

    def op() -> None:
        assert not Patch.active
        now[0] += 300e-6

    got = overhead.paired_pipelined_us(op, raw, Patch(), calls=10, rounds=5)
    assert got == pytest.approx(200.0)
    assert len(raw_saw) == 50 and all(raw_saw)


def test_piecewise_bench_builds_plan_and_upload_at_every_call_as_a_served_step_does(fake_flashinfer):
    """A FlashInfer step plans its wrappers, and a step uploads its device fields, once per
    metadata object: the bench's timed calls each run on a build of their own, so every call
    plans and uploads (the forced piecewise decode, timed on one metadata, did neither after its
    first call: 1.044x the full graph, which does both every replay)."""
    from compiled_attn.bench.piecewise_bench import step_builds

    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, num_blocks=64,
                            dtype=torch.bfloat16, device="cpu")
    backend = ca.registry.BACKEND_CLASSES()["FLASHINFER"]
    build, wrappers, built = step_builds(backend, spec, [40, 17], [1, 1]), {}, []
    for _ in range(8):
        md = build()  # kept alive in `built`: a freed object's id() may be reused by the next build
        assert all(md is not old for old in built) and not md.is_uploaded("slot_mapping")
        built.append(md)
        md.step_plan.ensure_planned(md)
        wrapper = md.step_plan.wrapper("decode")
        wrappers[id(wrapper)] = wrapper
        assert md.seq_lens_tensor.tolist() == [40, 17]
    assert sum(len(w.plans) for w in wrappers.values()) == 8  # plan() calls, over the builder's two slots
    assert torch.equal(build().slot_mapping, build().slot_mapping)  # the same blocks at every build
    # the mixed-step choice of one builder, the environment left as it was
    one_prefill = step_builds(backend, spec, [40, 17], [1, 1], mixed="prefill")
    assert one_prefill().step_plan.mixed_as_prefill and not build().step_plan.mixed_as_prefill
    assert os.environ[fib.MIXED_STEP_ENV] == "split"  # the fake_flashinfer fixture's


def test_piecewise_bench_steps_are_the_issues_mixed_and_prefill_steps():
    """63 decodes at ctx 1024 + one 256-token chunk (319 tokens); 8 prompts of 512 (4096 tokens);
    positions continue each request's cached prefix, blocks are distinct."""
    backend = ca.get_attn_backend("TORCH_SDPA")
    spec = LlamaConfig().attention_spec(block_size=16, num_blocks=4500, dtype=torch.float32, device="cpu",
                                        max_seq_len_to_capture=2048)
    (_, *mixed), (_, *prefill) = STEPS
    md, ids, pos = step_inputs(backend, spec, *mixed, vocab=100)
    assert (md.num_prefills, md.num_decodes, md.num_tokens) == (1, 63, 319)
    assert pos[:256].tolist() == list(range(256, 512)) and pos[256:].eq(1024).all()
    assert ids.shape == (319,) and md.slot_mapping.unique().numel() == 319
    md, _, pos = step_inputs(backend, spec, *prefill, vocab=100)
    assert (md.num_prefills, md.num_decodes, md.num_tokens) == (8, 0, 4096)
    assert pos.tolist() == list(range(512)) * 8 and md.slot_mapping.unique().numel() == 4096
    assert QUICK_BUCKETS == (320, 4096)  # --quick captures the buckets of these two steps only


def test_seconds_line_says_where_the_run_went():
    seconds = {"compiled_attn.bench.ceilings": 0.6, "compiled_attn.bench.decode_loop": 95.3}
    assert seconds_line(seconds) == "suite seconds: ceilings 0.6, decode_loop 95.3; total 95.9"


def test_bench_shows_rows_as_measured_unless_logging_is_configured(monkeypatch, capsys):
    """`python -m compiled_attn bench` prints the long suites' rows as they come (a run stopped at
    its limit shows how far it got); a caller that configured logging keeps its own setup."""
    import logging

    bench_log = logging.getLogger("compiled_attn.bench")
    monkeypatch.setattr(bench_log, "handlers", [])
    monkeypatch.setattr(bench_log, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    show_rows_as_measured()
    assert bench_log.handlers == []  # configured by the caller: left alone
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    show_rows_as_measured()
    assert len(bench_log.handlers) == 1
    monkeypatch.setattr(bench_log.handlers[0], "stream", sys.stderr)  # capsys's stream
    logging.getLogger("compiled_attn.bench.piecewise_bench").info("piecewise_bench: %s", {"us": 1.5})
    assert "compiled_attn.bench.piecewise_bench: piecewise_bench: {'us': 1.5}" in capsys.readouterr().err


def test_launch_only_times_the_call_without_the_synchronize_after_it(monkeypatch):
    """`eager_time_us(launch_only=True)`: the host's part of a call (an op's overhead without the
    GPU's time); the default: the call and its synchronize. On a fake clock that only the call
    (1 ms) and the synchronize (3 ms) advance, so the figures are exact on any host."""
    import types

    from compiled_attn.bench import timing

    now, synced = [0.0], []

    def advance(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(1) or advance(3e-3))
    full = timing.eager_time_us(lambda: advance(1e-3), iters=5)
    launch = timing.eager_time_us(lambda: advance(1e-3), iters=5, launch_only=True)
    assert full == pytest.approx(4000) and launch == pytest.approx(1000)
    assert len(synced) == 2 * (5 + 1)  # a synchronize after every timed call and after the warm-up, both ways


def test_compile_counts_tell_a_compile_from_a_cache_load():
    """A suite's compile counts: one graph per Dynamo trace; Inductor's first compile of it
    misses the FX-graph cache, the same compile after `torch._dynamo.reset()` (a second runner's)
    comes from it: how a bench run tells that its "warm" compiles were warm."""
    from torch._inductor.utils import fresh_cache

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2

    counts = []
    with fresh_cache():
        for _ in range(2):
            torch._dynamo.reset()
            before = compile_counts()
            torch.compile(step)(torch.randn(8))
            counts.append(counts_since(before))
    cold, warm = counts
    assert cold["graphs"] == warm["graphs"] == 1 and cold["compile s"] > 0
    # the phases: Inductor's codegen (seconds here) on the miss only; the backend is part of the compile
    assert cold["codegen s"] > 0 and warm["codegen s"] == 0
    assert 0 < cold["codegen s"] <= cold["backend s"] <= cold["compile s"]
    assert (cold["fx cache miss"], warm["fx cache hit"]) == (1, 1)
    assert (cold["fx cache hit"], warm["fx cache miss"]) == (0, 0)


def test_compile_seconds_survive_a_reset():
    """`torch._dynamo.reset()` clears Dynamo's compile times (a suite that resets then read a
    negative share); `reset_dynamo` keeps them, so a suite's share is what it compiled. Raw
    totals: `counts_since` rounds to 0.1 s, which a tiny compile may not reach."""
    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) + 1

    def total() -> float:
        return compile_counts()["compile s"]

    before, graphs_before = total(), compile_counts()["graphs"]
    torch.compile(step)(torch.randn(8))
    first, phases = total(), compile_counts()
    reset_dynamo()
    assert first > before and total() == pytest.approx(first)
    assert compile_counts() == pytest.approx(phases)  # every phase's seconds too
    torch.compile(step)(torch.randn(8))
    assert total() > first
    assert compile_counts()["graphs"] - graphs_before == 2


def test_compiles_line_names_the_suites_that_compiled():
    idle = {"graphs": 0, "compile s": 0.0, "backend s": 0.0, "autotune s": 0.0, "fx cache hit": 0,
            "fx cache miss": 0, "fx cache bypass": 0}
    e2e = {**idle, "graphs": 1, "compile s": 61.2, "backend s": 52.0, "autotune s": 2.4, "fx cache hit": 1}
    assert compiles_line({"compiled_attn.bench.ceilings": idle, "compiled_attn.bench.e2e": e2e}) == (
        "suite compiles: e2e 1 graphs 61 s (trace 9 s; fx cache 1 hit, 0 miss, 0 bypass) then autotune 2 s")


def test_autotune_seconds_sum_inductors_runtime_tuning(monkeypatch):
    """`autotune s`: Inductor's runtime config benchmarks and coordinate-descent tuning, timed by
    Dynamo under their own keys (GPU only: stand-in entries here), summed."""
    from torch._dynamo.utils import compilation_time_metrics

    before = compile_counts()["autotune s"]
    for key, seconds in (("CachingAutotuner.benchmark_all_configs", [1.5, 0.25]),
                         ("CachingAutotuner.coordinate_descent_tuning", [2.0])):
        monkeypatch.setitem(compilation_time_metrics, key, [*compilation_time_metrics.get(key, ()), *seconds])
    assert compile_counts()["autotune s"] == pytest.approx(before + 3.75)


def test_several_compiles_are_fresh_tuning_draws():
    """More than one compile per side: Inductor's caches off (a hit would replay the first
    tuning draw); the settings are Inductor's own (patch refuses unknown names)."""
    assert fresh_draws(1) == {}
    with torch._inductor.config.patch({**PEER_INDUCTOR, **fresh_draws(2)}):
        assert torch.compiler.config.force_disable_caches
    assert not torch.compiler.config.force_disable_caches


def test_decode_loop_fp8_flashinfer_variant_names_flashinfers_decode():
    """"fp8-flashinfer" keeps FlashInfer's fp8 decode measurable now that "auto" takes Triton's."""
    assert dl.VARIANT_ENV["fp8-flashinfer"] == {dl.FLASHINFER_GRAPH_DECODE_ENV: "flashinfer"}
    assert dl.VARIANT_BACKEND["fp8-flashinfer"] == "FLASHINFER"
    assert "fp8-flashinfer" in dl.VARIANTS


def test_decode_loop_rows_split_setup_from_timed_seconds(monkeypatch):
    """A decode-loop row says how long its side took to build, compile and run its first loop
    (`setup s`) and how long its timed loops took (`timed s`): the first loop (0.3 s of a fake
    clock, standing in for the compile) is setup, the timed loops (40 ms each) are not. The clock
    is the bench's own, advanced only by the loops, so the figures are exact on any host."""
    import types

    calls, now = [], [100.0]

    def fake_loop(steps: int, sync_each: bool) -> None:
        calls.append(sync_each)
        now[0] += 0.3 if len(calls) == 1 else 0.04

    monkeypatch.setattr(dl, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    def peer_loop(model, batch, ctx, sdpa):
        # one draw: Inductor's caches stay on (a warm --quick), AOTAutograd's is off all the same
        # (its key leaves out the SDPA choice, and its entries outlive the process)
        assert not torch._functorch.config.enable_autograd_cache
        assert not torch._inductor.config.force_disable_caches
        return fake_loop

    monkeypatch.setattr(dl, "peer_loop", peer_loop)
    monkeypatch.setattr(dl, "nominal_bandwidth", lambda: 1e12)
    monkeypatch.delenv(dl.AUTOGRAD_CACHE_ENV, raising=False)
    model = build_model(TINY_LOOP, seed=0, backend="TORCH_SDPA")
    row = dl.measure_peer(model, batch=2, ctx=16, compiles=1, repeats=3, sdpa=("math",))
    assert calls == [False] + [False] * 3 + [True] * 3  # one warm-up, then pipelined and synced loops
    assert row["setup s"] == 0.3 and row["timed s"] == 0.2  # six timed loops: 0.24 s, rounded
    assert row["ms/step"] == pytest.approx(40.0 / dl.STEPS)  # the timed loops' ms a step, not the warm-up's
    assert row["ms/step synced"] == pytest.approx(40.0 / dl.STEPS)
    monkeypatch.setenv(dl.AUTOGRAD_CACHE_ENV, "1")  # torch's override would undo the peer's patch
    with pytest.raises(RuntimeError, match="unset it for the peer"):
        dl.measure_peer(model, batch=2, ctx=16, compiles=1, repeats=3, sdpa=("math",))
    assert len(calls) == 7  # refused before any compile


@pytest.mark.parametrize("argv", [[], ["--peer-sdpa", "math"]], ids=["default", "math"])
def test_profile_decode_compiles_its_peer_as_the_bench_does(monkeypatch, tmp_path, argv):
    """The profile's peer runs under `peer_compiling` (AOTAutograd's cache off: it would replay
    another SDPA choice's lowering) on the faster SDPA choice unless told otherwise."""
    from test_cli import script

    profile = script("profile_decode")
    seen = []

    def peer_loop(model, batch, ctx, sdpa):
        seen.append((sdpa, torch._functorch.config.enable_autograd_cache,
                     torch._inductor.config.coordinate_descent_tuning))
        return "peer loop"

    backend = types.SimpleNamespace(get_name=lambda: "FLASHINFER")
    monkeypatch.setattr(dl, "build_8b", lambda name: types.SimpleNamespace(
        layers=[types.SimpleNamespace(attn=types.SimpleNamespace(backend=backend))]))
    monkeypatch.setattr(dl, "peer_loop", peer_loop)
    monkeypatch.setattr(dl, "paged_loop", lambda model, b, c, variant: types.SimpleNamespace(
        loop="ours loop", host_us=lambda: {}))
    monkeypatch.setattr(profile, "trace", lambda loop: {"loop ms/step": 1.0, "loop ms/step synced": 1.0,
                                                          "gpu busy in the loop": 0.5})
    monkeypatch.setattr(profile, "host_profile", lambda ours, path: None)
    monkeypatch.setattr(profile, "card_name", lambda: "card")
    monkeypatch.setattr(profile, "markdown", lambda table, title: title)
    monkeypatch.delenv(dl.AUTOGRAD_CACHE_ENV, raising=False)
    cache_before = torch._functorch.config.enable_autograd_cache
    profile.main(["--point", "1x16", "--out", str(tmp_path), *argv])
    assert seen == [(argv[1] if argv else dl.FASTER_PEER_SDPA, False, True)]
    assert torch._functorch.config.enable_autograd_cache == cache_before  # the patch ends with the peer


def test_profile_decode_busy_in_the_loop_is_kernel_time_over_the_unprofiled_step(monkeypatch):
    """The loop's GPU-busy fraction divides the trace's kernel time per step by the pipelined step
    timed without the profiler; the profiled span's fraction stays beside it."""
    import contextlib

    from test_cli import script

    from compiled_attn.bench.kernel_table import Kernel

    profile = script("profile_decode")
    steps, layers = profile.PROFILED_STEPS, dl.LlamaConfig.llama3_8b().num_layers
    # per step: one 90 us kernel a layer and one 120 us step kernel, then a 400 us gap
    kernels, t = [], 0.0
    for _ in range(steps):
        for name, us in [("layer", 90.0)] * layers + [("head", 120.0)]:
            kernels.append(Kernel(name, t, t + us))
            t += us
        t += 400.0
    monkeypatch.setattr(dl, "loop_times", lambda loop: (3.2, 3.5))
    monkeypatch.setattr(profile, "profile", lambda activities: contextlib.nullcontext())
    monkeypatch.setattr(profile, "cuda_kernels", lambda prof: kernels)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    table = profile.trace(lambda n, synced: None)
    kernel_us = layers * 90.0 + 120.0
    assert table["kernel us/step"] == pytest.approx(kernel_us)
    assert table["gpu busy in the loop"] == pytest.approx(kernel_us / 3200.0)
    assert table["gpu busy"] == pytest.approx(kernel_us * steps / (t - 400.0))
    assert (table["loop ms/step"], table["loop ms/step synced"]) == (3.2, 3.5)


def test_decode_loop_peer_reports_its_faster_sdpa_choice(monkeypatch):
    """The peer compiles each SDPA choice `compiles` times and reports the fastest draw of all,
    naming its choice: a ratio is to the stronger peer, not to gpt-fast's pinned kernel alone."""
    step_ms = {"math": [9.0, 8.0], "dispatch": [6.0, 7.0]}
    built = []

    def fake_peer_loop(model, batch, ctx, sdpa):
        # a cache hit across choices would replay the other choice's lowering (PyTorch issue 185449)
        assert not torch._functorch.config.enable_autograd_cache
        assert torch._inductor.config.force_disable_caches  # two draws a choice: fresh compiles
        ms = step_ms[sdpa][sum(b == sdpa for b in built)]
        built.append(sdpa)
        return lambda steps, sync_each: ms

    monkeypatch.setattr(dl, "peer_loop", fake_peer_loop)
    monkeypatch.setattr(dl, "warm_up_seconds", lambda loop: None)
    monkeypatch.setattr(dl, "loop_times", lambda loop, repeats, warm_up: (loop(0, False), loop(0, True) + 0.5))
    monkeypatch.setattr(dl, "nominal_bandwidth", lambda: 1e12)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    model = build_model(TINY_LOOP, seed=0, backend="TORCH_SDPA")
    row = dl.measure_peer(model, batch=2, ctx=16, compiles=2, repeats=1)
    assert built == ["math", "math", "dispatch", "dispatch"]
    assert row["peer sdpa"] == "dispatch" and row["ms/step"] == 6.0 and row["ms/step synced"] == 6.5
    assert row["peer compiles ms"] == {"math": [9.0, 8.0], "dispatch": [6.0, 7.0]}


@pytest.mark.parametrize("sides", [("peer", "ours"), ("ours",), ("peer",)])
def test_decode_loop_measures_the_sides_it_is_told(monkeypatch, sides):
    calls = []
    monkeypatch.setattr(dl, "build_8b", lambda name, kv_cache_dtype="auto": calls.append(f"build {name}") or name)
    monkeypatch.setattr(dl, "fits", lambda model, batch, ctx: True)
    monkeypatch.setattr(dl, "measure_peer", lambda model, b, c, compiles, repeats, sdpa: calls.append("peer") or
                        {"batch": b, "ctx": c, "side": "peer", "ms/step": 4.0})
    monkeypatch.setattr(dl, "measure_ours", lambda model, b, c, variant, repeats, compiles: calls.append(model) or
                        {"batch": b, "ctx": c, "side": "ours", "ms/step": 5.0})
    monkeypatch.setattr(dl, "fp8_rows", lambda name, peer_ms: calls.append(f"fp8 {name}") or [])
    monkeypatch.setattr(dl, "GRID", ((8, 1024),))
    rows = dl.run(backends=("FLASHINFER", "TORCH_SDPA"), sides=sides)  # the grid: fp8 rows at its end
    peer, ours = "peer" in sides, "ours" in sides
    want = (["build FLASHINFER"] + ["peer"] * peer + ["FLASHINFER"] * ours
            + ["build TORCH_SDPA", "TORCH_SDPA", "fp8 FLASHINFER"] * ours)
    assert calls == want
    assert [r["side"] for r in rows] == ["peer"] * peer + ["ours", "ours"] * ours
    assert all(r.get("vs peer") == (0.8 if peer else None) for r in rows if r["side"] == "ours")
    with pytest.raises(ValueError, match="sides must be"):
        dl.run(points=((8, 1024),), sides=("theirs",))


@pytest.mark.parametrize(("quick", "asked", "want"), [
    (False, None, ("math", "dispatch")), (True, None, ("dispatch",)), (True, ("math",), ("math",))])
def test_decode_loop_peer_sdpa_choices(monkeypatch, quick, asked, want):
    """The full grid's peer compiles every SDPA choice, `--quick`'s the dispatch alone (the faster
    where both were measured), unless told; an unknown choice is refused before any build."""
    got, built = [], []
    monkeypatch.setattr(dl, "build_8b", lambda name, kv_cache_dtype="auto": built.append(name) or name)
    monkeypatch.setattr(dl, "fits", lambda model, batch, ctx: True)
    monkeypatch.setattr(dl, "measure_peer", lambda model, b, c, compiles, repeats, sdpa: got.append(sdpa) or
                        {"batch": b, "ctx": c, "side": "peer", "ms/step": 4.0})
    dl.run(quick, backends=("TORCH_SDPA",), points=((1, 64),), sides=("peer",), peer_sdpa=asked)
    assert got == [want] and built == ["TORCH_SDPA"]
    with pytest.raises(ValueError, match="peer_sdpa must be"):
        dl.run(quick, backends=("TORCH_SDPA",), points=((1, 64),), sides=("peer",), peer_sdpa=("flash",))
    assert built == ["TORCH_SDPA"]


def test_overhead_copy_rows_time_each_copy_form_and_build():
    from compiled_attn.bench import overhead

    rows = overhead.copy_rows(iters=2, device="meta", batch=4, ctx=64)  # meta: a device copy on a CPU machine
    assert [r["what"].split(": ", 1)[1] for r in rows] == [
        "one pinned copy (upload)", "one pageable copy per array", "one pageable copy, packed",
        "build() and its upload, tables as array"]
    assert all(r["us/call"] > 0 for r in rows)


def test_bytes_per_step_counts_the_embedding_rows_gathered_not_the_table():
    """A step reads every weight but the embedding table, of which only its batch's rows, and
    the K/V of its requests at the loop's mean length, ctx + (STEPS + 1) / 2 tokens."""
    model = build_model(TINY_LOOP, seed=0, backend="TORCH_SDPA")
    c, table = TINY_LOOP, model.embed.weight
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    batch, ctx = 3, 100
    kv = 2 * batch * (ctx + (dl.STEPS + 1) / 2) * c.num_layers * c.num_kv_heads * c.head_size * 2  # bf16 cache
    want = everything - table.numel() * table.element_size() + batch * c.hidden_size * table.element_size() + kv
    assert dl.bytes_per_step(model, batch, ctx) == int(want)
    assert table.numel() > batch * c.hidden_size  # the table is more than the rows read


@pytest.mark.parametrize("fed", [False, True])
def test_decode_loop_feeds_tokens_back_without_positions_when_the_runner_derives_them(monkeypatch, fed):
    """The "feedback" variant's loop: no positions made, each step's returned rows passed straight
    back (copy_output=False) and copied only to be kept; the plain loop passes positions."""
    calls, buffer = [], torch.zeros(2, dtype=torch.int64)

    class Runner:
        feed_back_tokens = fed

        def run(self, md, tokens, positions=None, *, copy_output=True):
            calls.append((tokens.data_ptr() == buffer.data_ptr(), positions is None, copy_output))
            buffer.copy_(tokens + 1)
            return buffer if not copy_output else buffer.clone()

    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)  # the plain loop's positions: no CUDA here
    loop = object.__new__(dl.PagedLoop)
    loop.batch, loop.ctx, loop.runner, loop.first = 2, 16, Runner(), torch.tensor([3, 5])
    loop.builder = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(
        TINY_LOOP.attention_spec(block_size=16, num_blocks=8, dtype=torch.float32, device="cpu"))
    loop.tables, loop.query_lens = np.arange(8, dtype=np.int32).reshape(2, 4), np.ones(2, dtype=np.int64)
    out = loop.loop(3, sync_each=False)
    assert out.tolist() == [[4, 5, 6], [6, 7, 8]]  # each step's tokens kept, though fed back in place
    assert calls == ([(False, True, False), (True, True, False), (True, True, False)] if fed
                     else [(False, False, True)] * 3)


def test_piecewise_bench_capture_rows_say_what_the_capture_compiled():
    """The capture row's compile columns come from the capture's own compiles: the piecewise
    model's one trace here (the pieces as traced), its seconds, Dynamo's share within them."""
    from compiled_attn.bench import piecewise_bench
    from compiled_attn.graphs import CUDAGraphRunner
    from compiled_attn.models.llama import allocate_kv_caches

    torch._dynamo.reset()
    backend = ca.get_attn_backend("TORCH_SDPA")
    spec = TINY_LOOP.attention_spec(block_size=16, num_blocks=8, dtype=torch.float32, device="cpu")
    model = build_model(TINY_LOOP, seed=0, backend="TORCH_SDPA")
    runner = CUDAGraphRunner(model, backend, spec, allocate_kv_caches(TINY_LOOP, backend, spec), capture_sizes=[],
                             piecewise=True, piecewise_sizes=[4], piece_compiler="eager", use_cuda_graphs=False,
                             progress=False)
    stats, compiles = piecewise_bench._capture_with_compiles(runner)
    assert compiles["traces"] == 1 and 0 < compiles["dynamo_s"] <= compiles["compile_s"]
    assert compiles["compile_s"] <= stats["seconds"] + 1e-3  # Dynamo's clock inside the capture's
    row = piecewise_bench._capture_row("TORCH_SDPA", "tiny", "capture", stats, compiles)
    assert row["traces"] == 1 and row["dynamo_s"] == pytest.approx(compiles["dynamo_s"], abs=1e-3)
    assert row["piece_compile_s"] == pytest.approx(stats["piecewise"]["compile_seconds"], abs=1e-3)  # rounded


def test_piecewise_bench_capture_compiles_are_the_captures_share(monkeypatch):
    """traces, compile_s and dynamo_s are what the process's totals grew by across the capture;
    Dynamo's share is the compiles' time less the backend's."""
    from compiled_attn.bench import piecewise_bench

    totals = iter([{"graphs": 3, "compile s": 10.0, "backend s": 6.0},
                   {"graphs": 5, "compile s": 14.5, "backend s": 7.0}])
    monkeypatch.setattr(piecewise_bench, "compile_counts", lambda: next(totals))
    runner = types.SimpleNamespace(capture=lambda: {"seconds": 5.0})
    assert piecewise_bench._capture_with_compiles(runner) == ({"seconds": 5.0},
                                                              {"traces": 2, "compile_s": 4.5, "dynamo_s": 3.5})


def test_piecewise_bench_capture_only_times_the_captures_alone(monkeypatch, capsys):
    """`--capture-only` (gpu_check's "capture" part): the named backend's first and warm captures,
    printed, and no step timed."""
    from compiled_attn.bench import piecewise_bench as pb

    called = []
    monkeypatch.setattr(pb, "capture_rows", lambda name: called.append(name) or [{"backend": name, "capture_s": 1.5}])
    monkeypatch.setattr(pb, "run", lambda *a: pytest.fail("the capture-only mode timed steps"))
    monkeypatch.setattr(sys, "argv", ["piecewise_bench", "--capture-only", "--backend", "FLASHINFER"])
    pb.main()
    assert called == ["FLASHINFER"] and "capture_s" in capsys.readouterr().out

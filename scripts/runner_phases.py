"""Where `CUDAGraphRunner.run`'s own host time goes on the decode-graph path (issue 13's goal:
run minus the replay <= 50 us at B=64), phase by phase, and whether the host's state decides it.

    python scripts/runner_phases.py [--points 1x1024,64x1024,64x4096] [--steps 200] [--modes synced,spun,busy]
                                    [--outputs copy,own,fed] [--out DIR]

The 8B shape with 2 layers (the runner's host work does not grow with layers; the graph launch
does), FLASHINFER, the model eager (no compile: nothing here depends on the kernels), one decode
graph of the point's batch. Each step is the decode loop's: `builder.build` from array tables,
positions copied from the host, `runner.run`, returning a copy of the tokens (`copy`, the
default) or the graphs' own rows (`own`: `copy_output=False`); or, on a runner made with
`feed_back_tokens=True` (`fed`), no positions made or copied and the returned rows fed back in
place. Three ways to start a step:

- synced: right after `torch.cuda.synchronize()` (the decode loop's `host_us` column);
- spun: after the synchronize, the host spins 2 ms in Python first (a host that was not asleep);
- busy: after the synchronize, a 2 ms sleep kernel is queued first, so the step never waits for
  the device and the host stays awake (what a pipelined loop's host costs).

Each phase is timed by wrapping the function that does it; the table gives medians over the
steps, in us, of each phase's time in a step (0 in a step that does not call it: the first fed
step copies ids from elsewhere, later ones do not).
`run` and `build` are whole calls; `rest of run` is run minus its timed phases (clone, slicing,
path choice, Python between). The graphs upload the metadata themselves, so `upload` appears only
where a State does not capture it. Written to DIR/runner-phases.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

import compiled_attn as ca
import compiled_attn.graphs.runner as runner_module
from compiled_attn.bench.decode_loop import greedy
from compiled_attn.bench.timing import card_name
from compiled_attn.graph_state import GraphState, StaticInputs
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model

BLOCK_SIZE = 16
SLEEP_CYCLES = int(4e6)  # ~2 ms of GPU time: longer than a step's host work
times: dict[str, list[float]] = defaultdict(list)  # seconds a step, by phase
step_calls: dict[str, list[float]] = defaultdict(list)  # the step in progress: seconds a call, by phase


def timed(name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            step_calls[name].append(time.perf_counter() - start)
    return wrapper


PHASES = {  # (owner, attribute): phase name; the run's own calls, outermost first
    (runner_module, "fill_padded"): "fill_padded (ids, positions)",
    (CUDAGraphRunner, "_check_inputs"): "checks: inputs",
    (CUDAGraphRunner, "_check_caches"): "checks: caches",
    (GraphState, "_check_step"): "prepare: check step",
    (StaticInputs, "wait_uploaded"): "prepare: wait for last upload",
    (StaticInputs, "upload"): "prepare: upload (H2D copy + event)",
    (GraphState, "begin_forward"): "begin_forward (plan)",
    (torch.cuda.CUDAGraph, "replay"): "replay (graph launch)",
}
TOP_LEVEL = ("fill_padded (ids, positions)", "checks: inputs", "checks: caches",
             "prepare (check, write, any upload)", "begin_forward (plan)", "replay (graph launch)")


def install() -> None:
    for (owner, attr), name in PHASES.items():
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    GraphState.prepare_graph_input_buffers = timed("prepare (check, write, any upload)",
                                                   GraphState.prepare_graph_input_buffers)


def point_rows(b: int, ctx: int, steps: int, modes: list[str], outputs: list[str]) -> list[str]:
    config = dataclasses.replace(LlamaConfig.llama3_8b(), num_layers=2)
    backend = ca.get_attn_backend("FLASHINFER")
    pages = -(-(ctx + steps * len(modes) * len(outputs) + 2) // BLOCK_SIZE)  # every step adds a token
    spec = config.attention_spec(block_size=BLOCK_SIZE, num_blocks=b * pages, dtype=torch.bfloat16, device="cuda",
                                 max_seq_len_to_capture=pages * BLOCK_SIZE)
    model = build_model(config, seed=0, backend="FLASHINFER", dtype=torch.bfloat16, device="cuda",
                        init_device="cuda")
    caches = [c.normal_() for c in allocate_kv_caches(config, backend, spec)]
    tables = np.random.default_rng(0).permutation(b * pages).astype(np.int32).reshape(b, pages)
    builder = backend.get_builder_cls()(spec)
    runners = {}
    for fed in sorted({output == "fed" for output in outputs}):
        runners[fed] = CUDAGraphRunner(model, backend, spec, caches, max_batch_size=b, capture_sizes=[b],
                                       progress=False, postprocess=greedy, feed_back_tokens=fed)
        runners[fed].capture()
    query_lens = np.ones(b, dtype=np.int64)
    tokens = torch.randint(config.vocab_size, (b,), device="cuda")
    seq_len = ctx
    rows = []
    for output, mode in itertools.product(outputs, modes):
        # no keyword for `copy`: an older tree's run() (an A/B against probe_old) has none
        own = {"copy_output": False} if output in ("own", "fed") else {}
        runner = runners[output == "fed"]
        times.clear()
        step_calls.clear()  # calls outside the steps (the capture)
        for _ in range(steps):
            seq_len += 1
            torch.cuda.synchronize()
            if mode == "spun":
                until = time.perf_counter() + 2e-3
                while time.perf_counter() < until:
                    pass
            elif mode == "busy":
                torch.cuda._sleep(SLEEP_CYCLES)
            start = time.perf_counter()
            md = builder.build(np.full(b, seq_len), query_lens, tables)
            positions = (None if output == "fed" else
                         torch.from_numpy(np.full(b, seq_len - 1, dtype=np.int64)).to("cuda", non_blocking=True))
            built = time.perf_counter()
            tokens = runner.run(md, tokens, positions, **own)
            ran = time.perf_counter()
            times["build + positions"].append(built - start)
            times["run"].append(ran - built)
            for name, calls in step_calls.items():  # a phase's time per step, 0 in a step without it
                times[name].append(sum(calls))
            step_calls.clear()
        med = {name: statistics.median(t + [0.0] * (steps - len(t))) * 1e6 for name, t in times.items()}
        rest = med["run"] - sum(med.get(name, 0.0) for name in TOP_LEVEL)
        head = f"{card_name()}, FLASHINFER, 8B shape x 2 layers, B={b} x ctx {ctx}, {mode}, {output}, {steps} steps"
        body = [f"  {name:<42} {us:8.1f}" for name, us in med.items()]
        body.append(f"  {'rest of run (clone, slicing, Python)':<42} {rest:8.1f}")
        body.append(f"  {'run minus replay (the goal: <= 50)':<42} {med['run'] - med['replay (graph launch)']:8.1f}")
        rows.append("\n".join([head, *body]))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default="1x1024,64x1024,64x4096")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default="synced,spun,busy")
    parser.add_argument("--outputs", default="copy,own,fed")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    install()
    rows = []
    for point in args.points.split(","):
        b, ctx = (int(x) for x in point.split("x"))
        rows += point_rows(b, ctx, args.steps, args.modes.split(","), args.outputs.split(","))
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "runner-phases.txt"), "w") as f:
        f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()

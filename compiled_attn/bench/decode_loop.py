"""The decode loop as users run it: ours through the public API vs gpt-fast's own static-cache loop.

Both sides generate greedily on the 8B-shaped model (`LlamaConfig.llama3_8b()`, bf16, the same
random weights), every request at `ctx` cached tokens when the loop starts, `STEPS` steps.

- **peer** (gpt-fast's `generate.py`, rebuilt on our weights): per-layer contiguous K/V buffers
  `[B, n_kv, ctx + 64, d]` registered on the module, the new K/V stored by index assignment at
  `input_pos`, SDPA with the causal mask's boolean row and `enable_gqa=True`; the step and its
  argmax compiled with `mode="reduce-overhead", fullgraph=True` under coordinate-descent tuning;
  `input_pos += 1` and the token fed straight back on the device. gpt-fast pins the math SDPA,
  which Inductor decomposes and fuses; at 64x1024 on an H200 the peer ran 11.82 ms a step with
  it and 7.18 with PyTorch's own SDPA dispatch (one device call; BENCHMARKS.md, thirty-second
  session). The peer compiles both (`PEER_SDPA`) and reports its best, so a ratio is to the
  stronger of the two (`--quick`: the dispatch alone, `QUICK_PEER_SDPA`, the faster at every
  point measured).
- **ours**: each step `builder.build(...)` for the grown sequences (shuffled block tables, the
  last block filling up), positions copied from the host, `runner.run(...)`, argmax on the
  device. `CUDAGraphRunner(compile=True)` compiles the eager model (see its docstring).

Both sides compile under coordinate-descent tuning, which picks kernel configs by timing them, so
a compile is a draw: `peer_compiles` / `ours_compiles` fresh compiles per side, the best one
reported. With more than one, each compile runs with Inductor's caches off
(`force_disable_caches`): a cache hit would replay the first draw instead of making a new one.

Columns: ms / step with one synchronize after the loop ("pipelined", what throughput sees) and
with a synchronize after every step ("synced", the latency an interactive user sees); MBU =
(weight bytes + live KV bytes read) / step time / nominal HBM bandwidth.

    python -m compiled_attn.bench.decode_loop [--quick] [--point 1x1024 ...] [--backend FLASHINFER ...]
        [--side peer|ours] [--peer-sdpa math|dispatch ...]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
import unittest.mock
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch._functorch.config
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import compiled_attn as ca
from compiled_attn.backends.flashinfer import GRAPH_DECODE_ENV as FLASHINFER_GRAPH_DECODE_ENV
from compiled_attn.backends.torch_sdpa import GRAPH_DECODE_ENV as SDPA_GRAPH_DECODE_ENV
from compiled_attn.bench.compiles import reset_dynamo
from compiled_attn.bench.models import shared_model
from compiled_attn.bench.report import print_table
from compiled_attn.bench.timing import card_name, nominal_bandwidth
from compiled_attn.cli import point
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.inductor_cache import keep_tuned_configs
from compiled_attn.models.llama import Llama, LlamaConfig, allocate_kv_caches, apply_rotary
from compiled_attn.registry import BACKEND_CLASSES

log = logging.getLogger(__name__)

STEPS = 56  # tokens per timed loop; the peer's cache holds ctx + 64 positions
REPEATS = 5  # timed loops per point; the median is reported
QUICK_REPEATS = 3
BLOCK_SIZE = 16
BACKENDS = ("FLASHINFER", "TORCH_SDPA")
SIDES = ("peer", "ours")
QUICK_POINTS = ((1, 1024), (64, 1024))
GRID = tuple((b, c) for c in (1024, 4096) for b in (1, 8, 64, 256))
FP8_POINTS = ((64, 4096),)  # backends with fp8 caches (FLASHINFER): e4m3, against the bf16 peer
# What gpt-fast's generate.py sets before compiling its decode step.
PEER_INDUCTOR = {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True}


# ---------------------------------------------------------------------------------------------
# The peer: gpt-fast's model.py / generate.py decode path on our weights


class StaticKVCache(nn.Module):
    """gpt-fast's KVCache: [B, n_kv, max_len, d] buffers written at `input_pos` by indexing."""

    def __init__(self, batch: int, num_kv_heads: int, max_len: int, head_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        shape = (batch, num_kv_heads, max_len, head_size)
        # random, not zeros: the cached prefix is read by every step (as a prefill would leave it);
        # drawn on the device (B=64 at ctx 4096 is 35 GB, minutes of host randn)
        self.register_buffer("k_cache", torch.randn(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.randn(shape, dtype=dtype, device=device))

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # input_pos [1]; k, v [B, n_kv, 1, d]
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


class GptFastDecoder(nn.Module):
    """The reference Llama's weights run gpt-fast's way (one shared position per step)."""

    def __init__(self, model: Llama, batch: int, max_len: int) -> None:
        super().__init__()
        c = model.config
        self.model = model
        dtype, device = model.embed.weight.dtype, model.embed.weight.device
        self.kv = nn.ModuleList(
            StaticKVCache(batch, c.num_kv_heads, max_len, c.head_size, dtype, device) for _ in range(c.num_layers)
        )
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=device)))

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """idx int64 [B, 1], input_pos int64 [1] -> logits [B, 1, vocab] (fp32)."""
        m, c = self.model, self.model.config
        b = idx.shape[0]
        mask = self.causal_mask[None, None, input_pos]  # [1, 1, 1, max_len]
        cos, sin = m.rope_cos[input_pos].expand(b, -1), m.rope_sin[input_pos].expand(b, -1)
        x = m.embed(idx.view(b))
        for layer, kv in zip(m.layers, self.kv, strict=True):
            q, k, v = layer.qkv_proj(layer.attn_norm(x)).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            q = apply_rotary(q.view(b, c.num_heads, c.head_size), cos, sin)
            k = apply_rotary(k.view(b, c.num_kv_heads, c.head_size), cos, sin)
            keys, values = kv.update(input_pos, k.unsqueeze(2), v.view(b, c.num_kv_heads, 1, c.head_size))
            o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
            x = x + layer.o_proj(o.view(b, layer.q_size))
            gate, up = layer.gate_up_proj(layer.mlp_norm(x)).chunk(2, dim=-1)
            x = x + layer.down_proj(F.silu(gate) * up)
        return m.lm_head(m.norm(x)).float().view(b, 1, -1)


def peer_decode_one_token(peer: GptFastDecoder, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """gpt-fast's `decode_one_token` with greedy sampling: the next token [B, 1], on the device."""
    logits = peer(x, input_pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True)


# the peer's SDPA choices: gpt-fast's pinned math kernel, and PyTorch's own dispatch
PEER_SDPA = {"math": [SDPBackend.MATH], "dispatch": None}
# The faster choice at every point measured (H200, thirty-third session: 5.04 against 5.35 ms a
# step at 1x1024, 7.36 against 11.60 at 64x1024, and at 8x4096 and 64x4096), and the one issue
# 13's reference figures match: what `--quick` compiles alone (to keep its compile count) and the
# profiling scripts' peer runs.
FASTER_PEER_SDPA = "dispatch"
QUICK_PEER_SDPA = (FASTER_PEER_SDPA,)
AUTOGRAD_CACHE_ENV = "TORCHINDUCTOR_AUTOGRAD_CACHE"  # torch's override of `enable_autograd_cache`


def peer_loop(model: Llama, batch: int, ctx: int, sdpa: str = "math") -> Callable[[int, bool], torch.Tensor]:
    """A fresh compile of the peer with the `PEER_SDPA[sdpa]` kernels: loop(steps, sync_each) -> tokens [B, steps]."""
    kernels = PEER_SDPA[sdpa]
    reset_dynamo()  # gpt-fast compiles in a fresh process per batch size: no shape reuse
    peer = GptFastDecoder(model, batch, ctx + 64)
    step = torch.compile(peer_decode_one_token, mode="reduce-overhead", fullgraph=True)
    first = torch.randint(model.config.vocab_size, (batch, 1), device="cuda")

    def loop(steps: int, sync_each: bool) -> torch.Tensor:
        input_pos = torch.tensor([ctx], device="cuda")
        cur, out = first, []
        for _ in range(steps):
            with sdpa_kernel(kernels) if kernels else contextlib.nullcontext():
                nxt = step(peer, cur, input_pos)
            input_pos += 1
            out.append(nxt.clone())  # the graph's output is overwritten by the next replay
            cur = nxt.clone()
            if sync_each:
                torch.cuda.synchronize()
        return torch.cat(out, dim=1)

    return loop


# ---------------------------------------------------------------------------------------------
# Ours: builder + CUDAGraphRunner, the public API only


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The next token of each row, captured into the runner's graphs (logits stay on the device)."""
    return logits.argmax(-1)


class PagedLoop:
    """Greedy decode through `builder.build` + `runner.run` for `batch` requests at `ctx` tokens."""

    def __init__(self, model: Llama, backend: type[ca.AttentionBackend], batch: int, ctx: int,
                 runner_kw: dict | None = None, seed: int = 0, kv_cache_dtype: str = "auto") -> None:
        config = model.config
        self.batch, self.ctx = batch, ctx
        pages = -(-(ctx + STEPS + 1) // BLOCK_SIZE)
        self.spec = config.attention_spec(block_size=BLOCK_SIZE, num_blocks=batch * pages, dtype=torch.bfloat16,
                                          device="cuda", max_seq_len_to_capture=ctx + STEPS + 1,
                                          kv_cache_dtype=kv_cache_dtype)
        # random values (fp8 caches: drawn in bf16, stored as fp8) stand for the prompts' K/V
        self.caches = [c.copy_(torch.randn_like(c, dtype=torch.bfloat16))
                       for c in allocate_kv_caches(config, backend, self.spec)]
        # shuffled block ids (requests own scattered blocks, as after a while of serving) in one
        # int32 array [batch, pages], as a server keeps its tables: build() reads each request's
        # needed prefix with no per-element Python work
        self.tables = np.random.default_rng(seed).permutation(batch * pages).astype(np.int32).reshape(batch, pages)
        self.query_lens = np.ones(batch, dtype=np.int64)
        self.builder = backend.get_builder_cls()(self.spec)
        self.runner = CUDAGraphRunner(model, backend, self.spec, self.caches, max_batch_size=batch,
                                      capture_sizes=[batch], progress=False, postprocess=greedy, **(runner_kw or {}))
        self.runner.capture()
        self.first = torch.randint(config.vocab_size, (batch,), device="cuda")

    def inputs(self, seq_len: int) -> tuple[ca.AttentionMetadata, torch.Tensor | None]:
        """The metadata and positions of a step for every request at `seq_len` tokens (positions
        None where the runner derives them: feed_back_tokens)."""
        md = self.builder.build(np.full(self.batch, seq_len), self.query_lens, self.tables)
        if self.runner.feed_back_tokens:
            return md, None
        positions = torch.from_numpy(np.full(self.batch, seq_len - 1, dtype=np.int64)).to("cuda", non_blocking=True)
        return md, positions

    def step(self, tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
        """One decode step for every request at `seq_len` tokens (the last one is `tokens`)."""
        return self.run(*self.inputs(seq_len), tokens)

    def run(self, md: ca.AttentionMetadata, positions: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
        """`runner.run` on a step from `inputs`. With feed_back_tokens (positions None) the returned
        tokens are the runner's input rows, fed back in place."""
        if positions is None:
            return self.runner.run(md, tokens, copy_output=False)
        return self.runner.run(md, tokens, positions)

    def host_us(self, steps: int = STEPS) -> dict[str, float]:
        """Median host time per synced step (the GPU idle, nothing queued): `build()` plus the
        positions' copy, `runner.run()` (its checks, copies, planning and the replay's launch), and
        the graph launch alone (`CUDAGraph.replay`, timed by wrapping it for these steps): run minus
        replay is the runner's own work."""
        cur, build, run, replay = self.first, [], [], []
        launch = torch.cuda.CUDAGraph.replay

        def timed_replay(graph: torch.cuda.CUDAGraph) -> None:
            t = time.perf_counter()
            launch(graph)
            replay.append(time.perf_counter() - t)

        torch.cuda.CUDAGraph.replay = timed_replay
        try:
            for i in range(steps):
                t0 = time.perf_counter()
                md, positions = self.inputs(self.ctx + 1 + i)
                t1 = time.perf_counter()
                cur = self.run(md, positions, cur)
                t2 = time.perf_counter()
                torch.cuda.synchronize()
                build.append(t1 - t0)
                run.append(t2 - t1)
        finally:
            torch.cuda.CUDAGraph.replay = launch
        us = {"build us": build, "run us": run, "replay us": replay}
        return {name: float(np.median(t)) * 1e6 for name, t in us.items()}

    def loop(self, steps: int, sync_each: bool) -> torch.Tensor:
        cur, out = self.first, []
        for i in range(steps):
            cur = self.step(cur, self.ctx + 1 + i)
            # fed back, the tokens are rows the next step rewrites: a copy to keep (the plain
            # runner's run() makes the same copy itself)
            out.append(cur.clone() if self.runner.feed_back_tokens else cur)
            if sync_each:
                torch.cuda.synchronize()
        return torch.stack(out, dim=1)


# ---------------------------------------------------------------------------------------------
# Timing


def loop_ms(loop: Callable[[int, bool], torch.Tensor], sync_each: bool, repeats: int = REPEATS,
            warm_up: bool = True) -> float:
    """Median ms per step of `loop(STEPS, sync_each)` (host clock, one sync after the loop)."""
    if warm_up:
        loop(STEPS, sync_each)  # compiles, captures, first-use kernels
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loop(STEPS, sync_each)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3 / STEPS)
    return float(np.median(times))


def loop_times(loop: Callable[[int, bool], torch.Tensor], repeats: int = REPEATS,
               warm_up: bool = True) -> tuple[float, float]:
    """(pipelined, synced) ms per step of `loop`, after one warm-up loop unless the caller ran it
    (`warm_up_seconds`): the second mode needs none."""
    return loop_ms(loop, False, repeats, warm_up), loop_ms(loop, True, repeats, warm_up=False)


def warm_up_seconds(loop: Callable[[int, bool], torch.Tensor]) -> float:
    """Wall seconds of one untimed pipelined loop: where a side compiles, captures and first
    runs its kernels (the peer compiles and records its graphs in its first steps)."""
    start = time.perf_counter()
    loop(STEPS, False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bytes_per_step(model: Llama, batch: int, ctx: int) -> int:
    """What a step must read: every weight but the embedding table, of which only the batch's
    rows are gathered, and the live K/V at the loop's mean length (ctx+1 .. ctx+STEPS tokens) in
    the layers' cache dtype."""
    c = model.config
    table = model.embed.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not table)
    rows = batch * table.shape[1] * table.element_size()
    itemsize = ca.kv_cache_torch_dtype(model.layers[0].attn.impl.kv_cache_dtype, torch.bfloat16).itemsize
    kv = 2 * batch * (ctx + (STEPS + 1) / 2) * c.num_layers * c.num_kv_heads * c.head_size * itemsize
    return int(weights + rows + kv)


def fits(model: Llama, batch: int, ctx: int) -> bool:
    """Both sides' caches (paged + the peer's contiguous ones, never alive together) fit the card."""
    c = model.config
    kv = 2 * batch * (ctx + 64) * c.num_layers * c.num_kv_heads * c.head_size * 2
    free, _ = torch.cuda.mem_get_info()
    return kv * 1.1 < free


def _row(model: Llama, batch: int, ctx: int, side: str, pipelined: float, synced: float) -> dict:
    moved = bytes_per_step(model, batch, ctx)
    return {"card": card_name(), "batch": batch, "ctx": ctx, "side": side, "ms/step": pipelined,
            "ms/step synced": synced, "tok/s": batch / pipelined * 1e3,
            "MBU": moved / (pipelined / 1e3) / (nominal_bandwidth() or float("nan"))}


def fresh_draws(compiles: int) -> dict:
    """Inductor settings for `compiles` tuning draws: caches off when there is more than one."""
    return {"force_disable_caches": True} if compiles > 1 else {}


@contextlib.contextmanager
def peer_compiling(compiles: int = 1) -> Iterator[None]:
    """The settings the peer's compiles run under (enter before its first step): gpt-fast's
    Inductor options, a warm cache's tuning reused on torch 2.11 as in ours
    (`keep_tuned_configs`), caches off for `compiles` > 1 draws, and AOTAutograd's cache off.
    That cache's key leaves out the SDPA choice (PyTorch issue 185449; torch 2.11 and 2.13
    alike), so a compile would replay the lowering of another choice compiled before, in this
    process or any earlier one. Inductor's own caches key the lowered graph and stay on unless
    draws are asked."""
    if os.environ.get(AUTOGRAD_CACHE_ENV, "0") != "0":  # it would override the patch below
        raise RuntimeError(f"{AUTOGRAD_CACHE_ENV}={os.environ[AUTOGRAD_CACHE_ENV]} forces AOTAutograd's cache on, "
                           "which would serve one SDPA choice's compile for another: unset it for the peer")
    keep_tuned_configs()
    with torch._inductor.config.patch({**PEER_INDUCTOR, **fresh_draws(compiles)}), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def measure_peer(model: Llama, batch: int, ctx: int, compiles: int, repeats: int = REPEATS,
                 sdpa: tuple[str, ...] = tuple(PEER_SDPA)) -> dict:
    """The best of `compiles` fresh peer compiles per SDPA choice in `sdpa` (keys of PEER_SDPA;
    each timed pipelined and synced); `peer sdpa` names the winner's choice. `setup s`: the wall
    seconds of the draws' builds, compiles and first loops; `timed s`: of their timed loops
    (where a `--quick` run's time goes)."""
    times, seconds = {choice: [] for choice in sdpa}, {"setup s": 0.0, "timed s": 0.0}
    with peer_compiling(compiles):
        for choice, draws in times.items():
            for _ in range(compiles):
                start = time.perf_counter()
                loop = peer_loop(model, batch, ctx, choice)
                warm_up_seconds(loop)
                warm = time.perf_counter()
                draws.append(loop_times(loop, repeats, warm_up=False))
                seconds["setup s"] += warm - start
                seconds["timed s"] += time.perf_counter() - warm
                del loop
                torch.cuda.empty_cache()
    best, choice = min((t, choice) for choice, draws in times.items() for t in draws)
    return {**_row(model, batch, ctx, "peer (gpt-fast)", *best), "peer sdpa": choice,
            "peer compiles ms": {s: [round(t[0], 3) for t in draws] for s, draws in times.items()},
            **{k: round(s, 1) for k, s in seconds.items()}}


VARIANTS = ("compile", "dynamic", "fp8", "fp8-flashinfer", "flashinfer-decode", "cudnn-decode", "triton-decode",
            "gather-decode", "feedback")
# the environment each variant's States are made under
VARIANT_ENV = {"flashinfer-decode": {FLASHINFER_GRAPH_DECODE_ENV: "flashinfer"},
               "cudnn-decode": {FLASHINFER_GRAPH_DECODE_ENV: "cudnn"},
               "triton-decode": {FLASHINFER_GRAPH_DECODE_ENV: "triton"},
               "fp8-flashinfer": {FLASHINFER_GRAPH_DECODE_ENV: "flashinfer"},
               "gather-decode": {SDPA_GRAPH_DECODE_ENV: "gather"}}
# ... and the one backend each of those variants means anything for
VARIANT_BACKEND = {"flashinfer-decode": "FLASHINFER", "cudnn-decode": "FLASHINFER", "triton-decode": "FLASHINFER",
                   "fp8-flashinfer": "FLASHINFER", "gather-decode": "TORCH_SDPA"}


def paged_loop(model: Llama, batch: int, ctx: int, variant: str = "compile") -> PagedLoop:
    """Ours through the runner, captured; variant "compile": `CUDAGraphRunner(compile=True)`;
    "dynamic": the README's `torch.compile(model, fullgraph=True, dynamic=True)` handed
    to the runner; "fp8": compile, on a model whose layers and caches are fp8 (e4m3; a row the peer
    cannot have); "fp8-flashinfer": fp8 with FLASHINFER's graphed decode on FlashInfer's kernels;
    "flashinfer-decode" / "cudnn-decode" / "triton-decode": compile, with FLASHINFER's
    graphed decode on that kernel (`graph_decode_kernel`; "compile" takes its rule);
    "gather-decode": compile, with TORCH_SDPA's graphed decode gathering each row's table where it
    would read the pages through FlexAttention (`torch_sdpa.graph_decode_kernel`); "feedback":
    compile, with `feed_back_tokens=True` (no positions made or copied, the tokens fed back in
    place: a graph step launches its replay and nothing else)."""
    backend = model.layers[0].attn.backend
    kw = {"compile": variant != "dynamic", "feed_back_tokens": variant == "feedback"}
    step_model = model if variant != "dynamic" else torch.compile(model, fullgraph=True, dynamic=True)
    kv_cache_dtype = model.layers[0].attn.impl.kv_cache_dtype
    with unittest.mock.patch.dict(os.environ, VARIANT_ENV.get(variant, {})):  # read as the runner's States are made
        return PagedLoop(step_model, backend, batch, ctx, kw, kv_cache_dtype=kv_cache_dtype)


def measure_ours(model: Llama, batch: int, ctx: int, variant: str = "compile", repeats: int = REPEATS,
                 compiles: int = 1) -> dict:
    """The row of `paged_loop(model, batch, ctx, variant)`, the best of `compiles` fresh compiles:
    loop times and host work per step; `setup s` / `timed s` as the peer's (the setup: the
    caches, the runner's compile and capture, the first loop)."""
    draws, seconds = [], {"setup s": 0.0, "timed s": 0.0}
    with torch._inductor.config.patch(fresh_draws(compiles)):
        for _ in range(compiles):
            start = time.perf_counter()
            reset_dynamo()  # a fresh trace and compile, as the peer's
            ours = paged_loop(model, batch, ctx, variant)
            warm_up_seconds(ours.loop)
            warm = time.perf_counter()
            draws.append((loop_times(ours.loop, repeats, warm_up=False), ours.host_us(),
                          ours.runner.backend.get_name(), ours.runner.capture_stats["one_token"]))
            seconds["setup s"] += warm - start
            seconds["timed s"] += time.perf_counter() - warm
            del ours
            torch.cuda.empty_cache()
    times, host_us, name, one_token = min(draws, key=lambda d: d[0])
    row = {**_row(model, batch, ctx, f"ours {name} ({variant})", *times), **host_us,
           **{k: round(s, 1) for k, s in seconds.items()}}
    if one_token is not None:  # batch 1: the compile the runner kept and each one's replay ms at capture
        row["one token"] = f"kept {one_token['compile']}; " + ", ".join(
            f"{k} {ms:.3f}" for k, ms in one_token["replay_ms"].items())
    if compiles > 1:
        row["ours compiles ms"] = [round(d[0][0], 3) for d in draws]
    return row


def build_8b(backend: str, kv_cache_dtype: str = "auto") -> Llama:
    """The 8B-shaped model (seed 0, bf16), shared with the bench's other 8B suites."""
    return shared_model(LlamaConfig.llama3_8b(), backend, kv_cache_dtype)


def run(quick: bool = False, backends: tuple[str, ...] = BACKENDS,
        points: tuple[tuple[int, int], ...] | None = None, peer_compiles: int | None = None,
        variants: tuple[str, ...] = ("compile",), on_row: Callable[[dict], None] = lambda row: None,
        ours_compiles: int = 1, sides: tuple[str, ...] = SIDES, peer_sdpa: tuple[str, ...] | None = None
        ) -> list[dict]:
    """Rows per (batch, ctx): the peer (with the first available backend's model; its SDPA
    choices `peer_sdpa`, default all of PEER_SDPA, QUICK_PEER_SDPA when quick), then ours per
    backend and variant (quick: the first available backend only, fewer timed loops, one peer
    compile), each side the best of its compiles (`fresh_draws`); the full grid (no `points`, not
    quick) ends with the fp8 rows at FP8_POINTS (the "fp8" variant measures them at given points).
    Points whose KV caches do not fit the card are reported as skipped. `on_row` sees each row as
    it is measured (a run cut short keeps what it printed). `sides`: "peer", "ours" or both; one
    side alone splits a point across two processes (or device calls) on the same machine, the
    ratio then taken from their rows."""
    unknown = set(sides) - set(SIDES)
    if unknown or not sides:
        raise ValueError(f"sides must be some of {SIDES}, got {sides}")
    fp8_at_end = points is None and not quick and "ours" in sides
    points = points or (QUICK_POINTS if quick else GRID)
    peer_compiles = peer_compiles or (1 if quick else 2)
    peer_sdpa = peer_sdpa or (QUICK_PEER_SDPA if quick else tuple(PEER_SDPA))
    if unknown_sdpa := set(peer_sdpa) - set(PEER_SDPA):
        raise ValueError(f"peer_sdpa must be some of {tuple(PEER_SDPA)}, got {sorted(unknown_sdpa)}")
    repeats = QUICK_REPEATS if quick else REPEATS
    rows, peer_ms = [], {}

    def add(row: dict) -> None:
        rows.append(row)
        log.info("decode_loop: %s", row)
        on_row(row)

    with_peer = "peer" in sides  # the peer runs once, on the first backend that builds
    for name in backends:
        try:
            model = build_8b(name)
        except (ca.BackendUnavailableError, NotImplementedError) as e:
            log.info("decode_loop: skipping %s: %s", name, e)
            continue
        for batch, ctx in points:
            if not fits(model, batch, ctx):
                add({"card": card_name(), "batch": batch, "ctx": ctx, "side": "skipped: KV does not fit"})
                continue
            if with_peer:
                add(measure_peer(model, batch, ctx, peer_compiles, repeats, peer_sdpa))
                peer_ms[batch, ctx] = rows[-1]["ms/step"]
            for variant in (v for v in variants if VARIANT_BACKEND.get(v, name) == name and "ours" in sides):
                # "fp8": the model with e4m3 layers and caches, against the bf16 peer
                ours = build_8b(name, kv_cache_dtype="fp8") if variant.startswith("fp8") else model
                add(with_ratio(measure_ours(ours, batch, ctx, variant, repeats, ours_compiles), peer_ms))
                del ours
        del model
        torch.cuda.empty_cache()
        with_peer = False
        if quick or "ours" not in sides:  # quick: each backend costs two coordinate-descent-tuned 8B compiles
            break
    for name in backends if fp8_at_end else ():
        if "fp8" in BACKEND_CLASSES()[name.upper()].supported_kv_cache_dtypes:
            for row in fp8_rows(name, peer_ms):
                add(row)
    return rows


def with_ratio(row: dict, peer_ms: dict[tuple[int, int], float]) -> dict:
    """`row` with its speed as a ratio to the peer's at the same point, where the peer ran."""
    if (row["batch"], row["ctx"]) in peer_ms:
        row["vs peer"] = peer_ms[row["batch"], row["ctx"]] / row["ms/step"]
    return row


def fp8_rows(backend: str, peer_ms: dict[tuple[int, int], float]) -> list[dict]:
    """Ours on `backend` with e4m3 KV caches at FP8_POINTS, as a ratio to the bf16 peer measured there."""
    model = build_8b(backend, kv_cache_dtype="fp8")
    rows = [with_ratio(measure_ours(model, batch, ctx, "fp8"), peer_ms) for batch, ctx in FP8_POINTS]
    del model
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--point", type=point, action="append", metavar="BxCTX", help="e.g. 64x1024 (repeatable)")
    parser.add_argument("--peer-compiles", type=int, default=None, help="per SDPA choice; default 2 (--quick: 1)")
    parser.add_argument("--peer-sdpa", action="append", choices=tuple(PEER_SDPA), default=None,
                        help="the peer's SDPA choice (repeatable; default both, --quick: dispatch)")
    parser.add_argument("--ours-compiles", type=int, default=1)
    parser.add_argument("--variant", action="append", choices=VARIANTS, default=None)
    parser.add_argument("--side", action="append", choices=SIDES, default=None,
                        help="measure only this side (repeatable; default both)")
    args = parser.parse_args(argv)
    points = tuple(args.point) if args.point else None
    print_table(run(args.quick, tuple(args.backend or BACKENDS), points, args.peer_compiles,
                    tuple(args.variant or ("compile",)), on_row=lambda row: print(row, flush=True),
                    ours_compiles=args.ours_compiles, sides=tuple(args.side or SIDES),
                    peer_sdpa=tuple(args.peer_sdpa or ()) or None))


if __name__ == "__main__":
    main()

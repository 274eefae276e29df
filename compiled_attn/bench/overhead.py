"""Per-call eager overhead of our ops vs the kernel they wrap, and of the two registration styles.

`torch.library.custom_op` adds Python dispatch on every call (pytorch #139500 reports 4-36 us);
`Library.define` + `impl` is the lower-level route. Under CUDA graphs neither costs anything at
replay: this matters for eager serving and for the first (planning) call only.

An op's overhead is what it adds to its raw kernel: the dispatcher, the layer and forward-context
lookups and the step checks (`ops.common.checked_step`, which checks in full only the first call
of a kind: `validation.check_layer_call`). The piecewise graphs' op groups call the op's Python
kernel, without the dispatcher: its own overhead column.

Host work per step besides the ops: `build()` on CPU specs (`build_rows`) and, on a GPU, a decode
step's metadata copies in their three forms and `build()` on a CUDA spec (`copy_rows`).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import unittest.mock
from collections.abc import Callable

import numpy as np
import torch

import compiled_attn as ca
from compiled_attn.bench.timing import card_name, eager_time_us, pipelined_host_us
from compiled_attn.capabilities import smallest_block_size
from compiled_attn.metadata import packed_copy, upload
from compiled_attn.ops.cache import write_kv_cache
from compiled_attn.ops.common import checked_step
from compiled_attn.ops.library import ATTENTION_SIGNATURE, python_kernel
from compiled_attn.registry import BACKEND_CLASSES

_lib = torch.library.Library("compiled_attn_bench", "FRAGMENT")
_lib.define("noop_lib(Tensor(a!) x) -> ()")


def _noop_impl(x: torch.Tensor) -> None:
    return None


for _key in ("CPU", "CUDA"):
    _lib.impl("noop_lib", _noop_impl, _key)
_lib.impl("noop_lib", _noop_impl, "Meta")


# the attention ops' schema and registration (one CompositeExplicitAutograd kernel), doing nothing
_lib.define("noop_attention" + ATTENTION_SIGNATURE)
_lib.impl("noop_attention", lambda query, key, value, kv_cache, output, layer_name: None, "CompositeExplicitAutograd")


@torch.library.custom_op("compiled_attn_bench::noop_custom", mutates_args=("x",))
def noop_custom(x: torch.Tensor) -> None:
    return None


def run(quick: bool = False) -> list[dict]:
    """Rows: op, us per call (median), its overhead over the raw kernel (`write_kv_cache`, an
    attention op's Python kernel with its step checks skipped; both timed with a synchronize
    after each call, which the difference cancels), the same overhead in host time alone (`host
    overhead us`: each call timed from its start on an idle GPU to its return), the same in a
    loop that never waits for the GPU (`pipelined overhead us`, and `pipelined op group overhead
    us` for the piecewise op groups' call: paired rounds, `paired_pipelined_us`) and, for our ops,
    the host time of those lookups and checks alone on a repeat step (`checks us`: no GPU work,
    so no synchronize)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    iters = 200 if quick else 1000
    x = torch.empty(8, device=device)
    rows = []
    direct = eager_time_us(lambda: _noop_impl(x), iters=iters)
    q, kv, cache = torch.empty(8, 32, 128, device=device), torch.empty(8, 8, 128, device=device), x.view(1, 8)
    for name, fn in (("custom_op", lambda: torch.ops.compiled_attn_bench.noop_custom(x)),
                     ("Library.define", lambda: torch.ops.compiled_attn_bench.noop_lib(x)),
                     ("Library.define, the attention ops' six arguments",
                      lambda: torch.ops.compiled_attn_bench.noop_attention(q, kv, kv, cache, q, "layer"))):
        t = eager_time_us(fn, iters=iters)
        rows.append({"card": card_name(), "what": f"no-op via {name}", "us/call": t, "overhead us": t - direct})

    for backend_name, backend in BACKEND_CLASSES().items():
        if backend.unavailable_reason() is None:
            rows += backend_rows(backend_name, backend, device, iters)
    return rows + build_rows(quick) + (copy_rows(iters) if device == "cuda" else [])


# Decode steps whose host work `build()` does each step: (requests, tokens each).
BUILD_POINTS = ((64, 1024), (256, 4096))


def build_rows(quick: bool) -> list[dict]:
    """Host time of `builder.build()` for a decode step of shuffled tables, block tables given as
    lists of lists and as one int32 array (what a server keeps), per builder (CPU specs: host
    work only, no device copies): every request at the same length each call (the same step
    again: from the second call the builder's kept block check finds nothing new), and (array
    only) a decode loop's steps, lengths staggered over a block and each one token longer per
    call."""
    rows, iters = [], 10 if quick else 50
    for batch, ctx in BUILD_POINTS:
        width = -(-(ctx + 1) // 16)
        grown = -(-(ctx + 1 + iters + 3) // 16)  # room for the growing steps (eager_time_us: 3 warm-ups)
        spec = ca.AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                                num_blocks=batch * grown, dtype=torch.float32, device="cpu")
        rng = np.random.default_rng(0)
        table = rng.permutation(batch * width).reshape(batch, width).astype(np.int32)
        wide = rng.permutation(batch * grown).reshape(batch, grown).astype(np.int32)
        seq_lens, query_lens = np.full(batch, ctx + 1), np.ones(batch, dtype=np.int64)
        for backend_name, backend in BACKEND_CLASSES().items():
            if not backend.supports_block_size(16):
                continue
            builder = backend.get_builder_cls()(spec)
            staggered = seq_lens - rng.integers(0, 16, batch)
            for form, tables, lens in (  # lens: each call's (seq_lens, query_lens)
                ("array", table, itertools.repeat((seq_lens, query_lens))),
                ("lists", table.tolist(), itertools.repeat((seq_lens.tolist(), query_lens.tolist()))),
                ("array, lengths growing", wide, ((staggered + i, query_lens) for i in itertools.count())),
            ):
                us = eager_time_us(lambda b=builder, t=tables, ln=lens: b.build(*next(ln), t), iters=iters)
                rows.append({"card": "host CPU", "what": f"{backend_name}: build() {batch} decodes x {ctx} tokens, "
                             f"tables as {form}", "us/call": us})
    return rows


def copy_rows(iters: int, device: str = "cuda", batch: int = 64, ctx: int = 1024) -> list[dict]:
    """Host time of a FLASHINFER decode step's metadata copies to `device` (no synchronize: what
    `build()` pays): its arrays in `upload`'s one pinned copy, against one pageable copy per
    array (`build()` before the fifteenth session) and one pageable copy of the same packed
    buffer, and `build()` itself on a spec of `device` with the upload an eager step's first op
    makes (`md.upload_pending()`: `build()` defers it, and a graph step never makes it)."""
    width = -(-(ctx + 16) // 16)
    specs = [ca.AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, num_blocks=batch * width,
                              dtype=torch.bfloat16, device=d) for d in ("cpu", device)]
    builders = [BACKEND_CLASSES()["FLASHINFER"].get_builder_cls()(spec) for spec in specs]
    rng = np.random.default_rng(0)
    table = rng.permutation(batch * width).reshape(batch, width).astype(np.int32)
    seq_lens, query_lens = ctx + 1 - rng.integers(0, 16, batch), np.ones(batch, dtype=np.int64)  # staggered
    md = builders[0].build(seq_lens, query_lens, table)
    # the builder froze its table (read-only); torch.from_numpy warns on those, so a writable copy
    arrays = {**md.host_arrays(), "block_tables": md.block_tables_host.copy(),
              "paged_kv_indices": md.needed_block_ids().astype(np.int32)}
    target = torch.device(device)
    rows = []
    for what, fn in (
        ("one pinned copy (upload)", lambda: upload(arrays, target)),
        ("one pageable copy per array",
         lambda: [torch.from_numpy(a).to(target, non_blocking=True) for a in arrays.values()]),
        ("one pageable copy, packed", lambda: packed_copy(arrays, lambda host: host.to(target, non_blocking=True))),
        ("build() and its upload, tables as array",
         lambda: builders[1].build(seq_lens, query_lens, table).upload_pending()),
    ):
        us = eager_time_us(fn, iters=iters, host_only=True)
        if target.type == "cuda":
            torch.cuda.synchronize()
        rows.append({"card": card_name(), "what": f"FLASHINFER decode step {batch} x {ctx}, to {device}: {what}",
                     "us/call": us})
    return rows


def paired_pipelined_us(fn: Callable[[], object], raw_fn: Callable[[], object],
                        raw_context: contextlib.AbstractContextManager, *, calls: int, rounds: int) -> float:
    """Median over `rounds` of `fn`'s pipelined host time per call less `raw_fn`'s, batches of
    `calls` each, the two timed one right after the other in each round
    (`timing.pipelined_host_us`), so that the host's drift (clocks, caches, neighbours) cancels
    within a pair. `raw_context` is entered around each of `raw_fn`'s batches (and may be
    entered again: a `unittest.mock.patch` is)."""
    diffs = []
    for _ in range(rounds):
        us = pipelined_host_us(fn, calls=calls)
        with raw_context:
            diffs.append(us - pipelined_host_us(raw_fn, calls=calls))
    return float(np.median(diffs))


def backend_rows(backend_name: str, backend: type[ca.AttentionBackend], device: str, iters: int) -> list[dict]:
    """The cache-write op and this backend's attention op: dispatcher call, and the op's Python
    kernel as the piecewise op groups call it, each vs the raw kernel."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    k = torch.randn(8, 8, 128, device=device).to(dtype)
    q = torch.randn(8, 32, 128, device=device).to(dtype)
    block_size = smallest_block_size(backend)
    spec = ca.AttentionSpec(num_heads=32, num_kv_heads=8, head_size=128, block_size=block_size, num_blocks=256,
                            dtype=dtype, device=device)
    md = backend.get_builder_cls()(spec).build([100] * 8, [1] * 8, [[i * 8 + j for j in range(7)] for i in range(8)])
    impl = backend.get_impl_cls()(32, 128, 128**-0.5, num_kv_heads=8)
    name, call = impl.register(1.0, 1.0, ca.AttentionType.DECODER)  # the name lives as long as `call`
    cache = torch.randn(backend.get_kv_cache_shape(256, block_size, 8, 128), device=device).to(dtype)
    out = torch.empty_like(q)
    op = backend.attention_op
    op_name = op.__name__
    kernel = python_kernel(op)
    # the attention op's raw kernel: its Python kernel with `checked_step` answering at once
    skip_checks = unittest.mock.patch.object(sys.modules[kernel.__module__], "checked_step", lambda *a: (call, md))
    write_op = torch.ops.compiled_attn.kv_cache_update
    rows = []
    with ca.set_forward_context(md):
        kernel(q, k, k, cache, out, name)  # first call: lazy planning stays out of the timings
        for what, raw_fn, raw_context, op_fn, direct_fn, checks_fn in (
            ("kv_cache_update (8 tokens)", lambda: write_kv_cache(k, k, cache, md.slot_mapping, 1.0, 1.0),
             contextlib.nullcontext(), lambda: write_op(q, k, k, cache, name),
             lambda: python_kernel(write_op)(q, k, k, cache, name), lambda: checked_step(name, q, k, k, cache)),
            (f"{op_name} (8 decodes, ctx 100)", lambda: kernel(q, k, k, cache, out, name), skip_checks,
             lambda: op(q, k, k, cache, out, name), lambda: kernel(q, k, k, cache, out, name),
             lambda: checked_step(name, q, k, k, cache, out)),
        ):
            with raw_context:
                raw_us = eager_time_us(raw_fn, iters=iters)
            op_us = eager_time_us(op_fn, iters=iters)
            with raw_context:
                raw_launch_us = eager_time_us(raw_fn, iters=iters, launch_only=True)
            # batches of about 5 ms (CPU kernels take milliseconds, GPU launches microseconds)
            pipelined = {"calls": max(2, min(iters, int(5000 / op_us))), "rounds": 15 if iters >= 200 else 3}
            rows.append({"card": card_name(), "what": f"{backend_name}: {what}", "us/call": op_us,
                         "overhead us": op_us - raw_us,
                         # the host's cost of the op over the raw call in a loop that never waits
                         # for the GPU: the least noisy of the overhead columns
                         "pipelined overhead us": paired_pipelined_us(op_fn, raw_fn, raw_context, **pipelined),
                         "pipelined op group overhead us": paired_pipelined_us(direct_fn, raw_fn, raw_context,
                                                                               **pipelined),
                         # host time alone (GPU idle at the call, its synchronize untimed): the
                         # overhead without the GPU time's and the synchronize's jitter
                         "host overhead us": eager_time_us(op_fn, iters=iters, launch_only=True) - raw_launch_us,
                         # the piecewise op groups' call: the op's Python kernel, no dispatcher
                         "op group overhead us": eager_time_us(direct_fn, iters=iters) - raw_us,
                         "checks us": eager_time_us(checks_fn, iters=iters, host_only=True)})
    return rows

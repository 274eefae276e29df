"""`CUDAGraphRunner`: decode steps replayed as CUDA graphs, optionally the other steps as
piecewise graphs, the rest run eagerly.

One graph per capture size and block-table width the State declares (one width for kernels
that read live lengths; several for TORCH_SDPA, whose gather grows with the table's width),
captured largest first into one shared memory pool (a smaller graph reuses the memory the
larger one made). Each step, a decode-only batch of n requests goes to the smallest captured
size >= n and the narrowest width that holds its longest sequence: the runner copies input ids
/ positions into its static buffers (rows n.. are pads), the backend's `AttentionState` does the
same for the attention metadata, and the graph replays. Prefill / mixed batches, batches above
the largest size and sequences above `spec.max_seq_len_to_capture` run the model eagerly instead,
or, with `piecewise=True`, replay piecewise graphs (`graphs/piecewise.py`) when their tokens fit
the largest token bucket: the model cut at its attention ops, each piece captured per bucket,
attention run eagerly between them with the step's own metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from compiled_attn.abstract import AttentionBackend, AttentionMetadata, AttentionSpec, AttentionState, AttentionType
from compiled_attn.distributed import failed_on_any_rank, slowest_rank_ms
from compiled_attn.dynamo import floats_as_constants, mark_token_dim
from compiled_attn.forward_context import set_forward_context
from compiled_attn.graphs.buckets import (
    GRAPH,
    PATHS,
    PIECEWISE,
    capture_sizes_for,
    capture_widths_for,
    choose_path,
    fill_padded,
    names_no_sizes,
    pick_batch_size,
    pick_table_width,
    piecewise_sizes_for,
)
from compiled_attn.graphs.compiler import (
    COMPILE_OPTIONS,
    ONE_TOKEN_COMPILES,
    PRIMARY_ONE_TOKEN_COMPILE,
    RunnerCompiler,
)
from compiled_attn.graphs.piecewise import PIECE_COMPILERS, PiecewiseGraphs
from compiled_attn.groups import GroupedMetadata
from compiled_attn.inductor_cache import keep_tuned_configs
from compiled_attn.metadata import token_positions_of
from compiled_attn.validation import as_int, check_cache_list, check_model_output

logger = logging.getLogger(__name__)

ModelStep = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor]], torch.Tensor]
INPUT_DTYPE = torch.int64  # input ids and positions, as the reference model takes them
ONE_TOKEN_TIMED_REPLAYS = 10  # a round per compile, three rounds alternating; the best round counts


class WithPostprocess(torch.nn.Module):
    """model then postprocess, as one module: compiled together, the postprocess (say, an
    argmax over the logits) fuses into the step's last kernels."""

    def __init__(self, model: ModelStep, postprocess: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.postprocess = model, postprocess

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        return self.postprocess(self.model(input_ids, positions, kv_caches))


@dataclasses.dataclass
class CapturedSize:
    """Everything one captured (batch size, table width) needs at replay; holding it keeps the
    graph's memory alive."""

    graph: torch.cuda.CUDAGraph | None  # None when use_cuda_graphs=False
    graph_state: AttentionState  # owns what the metadata for this size and width made (wrappers, biases)
    input_buffers: dict[str, torch.Tensor]  # the static metadata tensors the graph reads
    metadata: AttentionMetadata  # the all-pad metadata the graph was captured with
    output: torch.Tensor | None  # rows [:bs] of the runner's one output buffer, rewritten by every replay
    # {"upload": False} when the graph copies the State's host data itself (upload_graph_input_buffers)
    prepare_kw: dict[str, bool] = dataclasses.field(default_factory=dict)


class CUDAGraphRunner:
    """Serve model steps through captured CUDA graphs where possible, eagerly otherwise.

    Args:
        model: the step, `model(input_ids, positions, kv_caches) -> logits`; input_ids and
            positions int64 [num_tokens], logits [num_tokens, ...]. Eager or already compiled
            (`torch.compile(model, fullgraph=True, dynamic=True)`); it reads attention metadata
            from the forward context, as every `ca.Attention` model does.
        backend, spec: the attention backend and the spec of the model's layers.
        kv_caches: one cache per layer. The graphs write these very tensors (by address): to use
            other caches, make and capture a new runner.
        state: the backend's `AttentionState` for `spec` (default: a new one). Its
            `graph_table_widths()` are the block-table widths captured for every size
            (`self.widths`; TORCH_SDPA's: 256 tokens' worth of blocks, doubling, up to the full
            table, or the full one only on FlexAttention; a State whose `MIN_TABLE_WIDTH_TOKENS`
            is None captures the full one only).
        max_batch_size: the largest batch a graph serves; capture sizes above it are dropped.
        capture_sizes: default `[1, 2, 4] + list(range(8, 257, 8))`. `[]` with `piecewise=True`:
            no decode graphs (no full-model compile or capture for them); decode steps take the
            piecewise graphs as every other step of up to the largest bucket's tokens does.
        warmup_steps: eager runs on a side stream before each capture (compile, lazy init).
        postprocess: applied to the model's output inside every step and graph, e.g. greedy
            sampling `lambda logits: logits.argmax(-1)`: `run` then returns tokens, and the
            [num_tokens, vocab] logits never leave the graph.
        compile: `model` is the eager module and the runner compiles it (with `postprocess`),
            gpt-fast's way: `torch.compile(fullgraph=True, dynamic=True)` with the token count
            a backed symbol, so batch 1 gets a static graph of its own where Inductor turns
            matrix-vector products into tuned reductions (COMPILE_OPTIONS) and every other size
            shares one graph. With CUDA graphs batch 1's trace is also compiled without the
            tuning (cuBLAS's GEMVs, `graphs/compiler.py`) and the compile whose graph replays
            faster at capture serves every one-token step (`capture_stats["one_token"]`). The
            caches it traces with are marked static (`torch._dynamo.mark_static`, an attribute on
            those tensors): symbolic, their sizes would meet Dynamo's duck sizing, which ties a
            first trace's token count to an equal cache size (8 KV heads, pages of 16) and makes
            the next other size trace the model again.
            False: run `model` as given (eager, or compiled by the caller, the token count
            marked unbacked so that no size recompiles); with `piecewise=True` the
            steps the decode graphs do not take run the runner's own pieces either way
            (compiled by `piece_compiler`), not the caller's compiled model.
        use_cuda_graphs: False runs the same padded static-buffer step without capturing it
            (isolates padding from capture problems when debugging; works on CPU).
        progress: show a progress bar while capturing.
        piecewise: also serve prefill / mixed steps (and decode steps no decode graph takes)
            of at most max(piecewise_sizes) tokens through piecewise graphs: the runner compiles
            the eager model once more (`fullgraph=True`, the token count symbolic), cut at the
            ops that read the forward context, each piece captured per token bucket into the
            same pool, attention eager between them (`graphs/piecewise.py`). Steps above the
            largest bucket run those compiled pieces without graphs. `model` may be the eager
            module or one compiled by `torch.compile` (its original module is used). DECODER
            specs only (an op's token rows are cut to the step's, which cross attention's
            encoder K/V are not). With `compile=True` the pieces get COMPILE_OPTIONS too.
        piecewise_sizes: token buckets, default `DEFAULT_PIECEWISE_SIZES` (1 .. 512).
        piece_compiler: "inductor" (default) or "eager" (the FX pieces as traced: fast to build,
            to test the splitting and padding).
        feed_back_tokens: for a decode loop that feeds each step's tokens back: `postprocess`
            returns the next token ids (int64 [num_tokens]) and the spec is DECODER. `run(md,
            input_ids)` then takes no positions: a token's is its index in its sequence,
            seq_len - query_len + i (what a RoPE model's caller passes), derived by the runner,
            inside the decode graphs from the State's static lengths and on the host for other
            steps. The decode graphs write their tokens into the static input-id buffer (pad
            rows 0), so `run(..., copy_output=False)` returns rows of it, and passing those back
            as the next step's input_ids (the same tensor, or its first rows once later requests
            have left) copies nothing: a decode-graph step makes no copy before its replay.

    Example::

        runner = CUDAGraphRunner(torch.compile(model, fullgraph=True, dynamic=True), backend, spec, kv_caches)
        runner.capture()                      # runner.capture_stats: seconds, pool bytes
        for step in steps:
            md = builder.build(seq_lens, query_lens, block_tables)
            logits = runner.run(md, input_ids, positions)    # [num_tokens, vocab]
        runner.counts                         # {'graph': ..., 'eager_prefill': ..., ...}
    """

    def __init__(
        self,
        model: ModelStep,
        backend: type[AttentionBackend],
        spec: AttentionSpec,
        kv_caches: list[torch.Tensor],
        state: AttentionState | None = None,
        *,
        max_batch_size: int = 256,
        capture_sizes: Sequence[int] | None = None,
        warmup_steps: int = 2,
        use_cuda_graphs: bool = True,
        progress: bool = True,
        postprocess: Callable[[torch.Tensor], torch.Tensor] | None = None,
        compile: bool = False,
        piecewise: bool = False,
        piecewise_sizes: Sequence[int] | None = None,
        piece_compiler: str = "inductor",
        feed_back_tokens: bool = False,
    ) -> None:
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            raise ValueError(f"backend must be an AttentionBackend class, got {backend!r}: pass "
                             "ca.get_attn_backend(name)")
        if state is not None and not isinstance(state, AttentionState):
            raise ValueError(f"state must be an AttentionState (backend.get_state_cls()(spec)) or None, got "
                             f"{type(state).__name__}")
        if use_cuda_graphs and spec.device.type != "cuda":
            raise ValueError(
                f"CUDA graphs need spec.device to be CUDA, got {spec.device} (use_cuda_graphs=False runs the "
                "static-buffer step without graphs)"
            )
        warmup_steps = as_int("warmup_steps (capture needs a warmed-up step)", warmup_steps)
        check_cache_list(kv_caches)
        decode_graphs = not names_no_sizes(capture_sizes)
        if not decode_graphs and not piecewise:
            raise ValueError("capture_sizes=[] captures no graph: pass piecewise=True to serve every step of up to "
                             "the largest bucket's tokens through the piecewise graphs, or name decode sizes")
        if piecewise and spec.attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"piecewise graphs serve DECODER specs, not {spec.attn_type.name}: run "
                                      "these steps with piecewise=False")
        if piecewise_sizes is not None and not piecewise:
            raise ValueError("piecewise_sizes without piecewise=True: pass piecewise=True to capture them")
        if piece_compiler not in PIECE_COMPILERS:
            raise ValueError(f"piece_compiler must be one of {PIECE_COMPILERS}, got {piece_compiler!r}")
        if feed_back_tokens and spec.attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"feed_back_tokens serves DECODER specs (a decode graph's pad rows are the ones "
                                      f"that write no cache), not {spec.attn_type.name}: pass positions to run()")
        if piece_compiler != "inductor" and not piecewise:
            raise ValueError(f"piece_compiler={piece_compiler!r} without piecewise=True: pass piecewise=True to "
                             "compile pieces")
        step = model if postprocess is None else WithPostprocess(model, postprocess)
        self.piecewise: PiecewiseGraphs | None = None
        if piecewise:
            eager = _original(model)
            self.piecewise = PiecewiseGraphs(
                eager if postprocess is None else WithPostprocess(eager, postprocess), kv_caches,
                sizes=piecewise_sizes_for(piecewise_sizes),
                device=spec.device, use_cuda_graphs=use_cuda_graphs, piece_compiler=piece_compiler,
                options=COMPILE_OPTIONS if compile else None, warmup_steps=warmup_steps,
            )
        if compile:
            keep_tuned_configs()  # torch 2.11: else a new process tunes every kernel again
        # With CUDA graphs and a batch-1 graph, batch 1 is traced once and compiled per
        # ONE_TOKEN_COMPILES entry; the capture keeps the faster (`_pick_one_token`) for every
        # one-token step.
        self._compiler = RunnerCompiler() if compile else None
        self.model = torch.compile(step, backend=self._compiler, fullgraph=True, dynamic=True) if compile else step
        self._one_token_stats: dict[str, Any] | None = None  # the pick: the kept compile, replay times
        self._group: dist.ProcessGroup | None = None  # a sharded model's ranks: batch 1's pick agrees across them
        self._unbacked_tokens = not compile
        self.backend = backend
        self.spec = spec
        # a list, as run() hands its eager paths: a tuple here would trace once more (Dynamo guards
        # the container's type); a list stays the caller's, whose replaced caches run() then finds
        self.kv_caches = kv_caches if isinstance(kv_caches, list) else list(kv_caches)
        self.state = backend.get_state_cls()(spec) if state is None else state
        max_batch_size = as_int("max_batch_size", max_batch_size)
        self.sizes = capture_sizes_for(max_batch_size, capture_sizes) if decode_graphs else []  # largest first
        self._pick_batch_one = compile and use_cuda_graphs and 1 in self.sizes
        # block-table widths per size, largest (the full table) first
        self.widths = capture_widths_for(self.state.graph_table_widths(),
                                         -(-spec.max_seq_len_to_capture // spec.block_size))
        self.warmup_steps = warmup_steps
        self.use_cuda_graphs = use_cuda_graphs
        self.progress = progress
        self.counts: dict[str, int] = dict.fromkeys(PATHS, 0)
        self.capture_stats: dict[str, Any] = {}
        self._captured: dict[tuple[int, int], CapturedSize] = {}  # by (batch size, table width)
        self._cache_ptrs: list[int] = []
        self._cache_numels: list[int] = []
        self._output: torch.Tensor | None = None  # every graph copies its output rows here
        self._graph_seconds = 0.0  # of the last capture: in the decode graphs' capture blocks only
        top = self.sizes[0] if self.sizes else 0
        # static model inputs; zeros are a valid token id and position for any model
        self._input_ids = torch.zeros(top, dtype=INPUT_DTYPE, device=spec.device)
        self._positions = torch.zeros(top, dtype=INPUT_DTYPE, device=spec.device)
        self._pads_from = 0  # rows of both from here on hold zeros (`fill_padded`)
        self.feed_back_tokens = feed_back_tokens
        if feed_back_tokens:  # the graphs write their tokens where the next step reads its ids
            self._output = self._input_ids

    # -- capture ---------------------------------------------------------------------------

    def capture(self, *, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """Capture one graph per size and table width, largest first, into one pool; returns
        `capture_stats`. group: the process group of a sharded model's ranks (pass it through
        `distributed.capture_sharded`, which checks the sizes first): batch 1's pick of compile
        then goes by each candidate's slowest rank, so every rank keeps the same one.

        capture_stats: num_graphs (sizes x table widths), sizes, table_widths (blocks), seconds,
        graph_seconds (of those, inside the decode graphs' captures: no warm-up, no compile),
        pool_bytes (memory the graph pool holds), allocated_bytes / reserved_bytes
        (memory_allocated / memory_reserved deltas: the State's buffers, graph outputs and the
        pool). Memory figures are None without CUDA graphs. piecewise: None, or the piecewise
        graphs' own figures (sizes, num_pieces, num_op_groups, num_graphs, compile_seconds,
        seconds, graph_seconds, pool_bytes: the pool after their capture); they share the pool,
        so pool_bytes and seconds cover them too. Piecewise buckets are captured first (the
        largest token counts). one_token: with `compile=True`, CUDA graphs and 1 among the
        capture sizes, the compile batch 1's graphs and one-token eager steps run (a name in
        ONE_TOKEN_COMPILES) and each one's best replay_ms at capture (this rank's), with
        slowest_rank_ms (the pick's figures, with a group of more than one rank) and failed (each
        candidate that failed to compile: its error), those keys only when they apply; else None.
        """
        if self.capture_stats:
            raise RuntimeError("this runner is captured already; make a new runner to capture again")
        self._check_caches_at_capture()
        if self._compiler is not None:  # before the first trace (run() refuses a step before capture)
            _mark_static(self.kv_caches)
        cuda = self.use_cuda_graphs
        device = self._input_ids.device
        if cuda:
            torch.cuda.synchronize(device)
            allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle() if cuda else None
        side_stream = torch.cuda.Stream(device) if cuda else None
        start = time.perf_counter()
        self._graph_seconds = 0.0
        self._one_token_stats = None  # a capture retried after a failure times again
        self._group = group
        if self._compiler is not None:
            self._compiler.kept = None
        piecewise_stats = None
        try:
            graphs = [(bs, width) for bs in self.sizes for width in self.widths]  # the largest graph first
            with _own_cublas_workspace(cuda):
                if self.piecewise is not None:
                    piecewise_stats = self.piecewise.capture(pool)
                    # the pool as the piecewise graphs left it; the decode graphs reuse its free memory
                    piecewise_stats["pool_bytes"] = _pool_bytes(pool, device) if cuda else None
                if graphs:
                    with self.state.graph_capture(self.sizes[0]):
                        for bs, width in _progress(graphs, self.progress,
                                                   desc=f"capturing {self.backend.get_name()} graphs"):
                            self._captured[bs, width] = self._capture_size(bs, width, pool, side_stream)
            if cuda:
                torch.cuda.synchronize(device)
        except BaseException:
            self._captured.clear()  # half a set of graphs would route batches to sizes never captured
            raise
        self.capture_stats = {
            "num_graphs": len(self._captured),
            "sizes": list(self.sizes),
            "table_widths": list(self.widths) if self.sizes else [],
            "seconds": time.perf_counter() - start,
            "graph_seconds": self._graph_seconds,
            "pool_bytes": _pool_bytes(pool, device) if cuda else None,
            "allocated_bytes": torch.cuda.memory_allocated(device) - allocated if cuda else None,
            "reserved_bytes": torch.cuda.memory_reserved(device) - reserved if cuda else None,
            "piecewise": piecewise_stats,
            "one_token": self._one_token_stats,
        }
        logger.info(
            "captured %d %s graphs (sizes %s, table widths %s blocks) in %.1f s; graph pool %s",
            len(self._captured), self.backend.get_name(),
            f"{self.sizes[-1]}..{self.sizes[0]}" if self.sizes else "none", self.capture_stats["table_widths"],
            self.capture_stats["seconds"], _mib(self.capture_stats["pool_bytes"]),
        )
        return self.capture_stats

    def _capture_size(self, bs: int, width: int, pool: Any, side_stream: torch.cuda.Stream | None) -> CapturedSize:
        # the full width is what the calls without table_width mean (any State takes them)
        narrower = {} if width == self.widths[0] else {"table_width": width}
        md_bs = self.state.graph_capture_get_metadata_for_batch(bs, **narrower)  # all pads: warm-up writes nothing
        input_buffers = self.state.get_graph_input_buffers(md_bs)
        graph_state = self.state.graph_clone(bs, **narrower)
        if side_stream is None:
            return CapturedSize(None, graph_state, input_buffers, md_bs, None)
        if bs == 1 and self._pick_batch_one and self._one_token_stats is None:
            graph, uploads = self._capture_batch_one(md_bs, input_buffers, graph_state, pool, side_stream)
        else:
            graph, uploads = self._capture_graph(bs, md_bs, input_buffers, graph_state, pool, side_stream)
        return CapturedSize(graph, graph_state, input_buffers, md_bs, self._output[:bs],
                            {"upload": False} if uploads else {})

    def _capture_batch_one(self, md_bs: AttentionMetadata, input_buffers: dict[str, torch.Tensor],
                           graph_state: AttentionState, pool: Any,
                           side_stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, bool]:
        """Batch 1's graph captured from each compile of its one trace; the faster replay's kept
        (`_pick_one_token`), and its compile serves every one-token step from then on."""
        primary = PRIMARY_ONE_TOKEN_COMPILE
        self._compiler.use = primary
        # the primary's calls trace batch 1 and compile every candidate
        graphs = {primary: self._capture_graph(1, md_bs, input_buffers, graph_state, pool, side_stream)}
        if not self._compiler.one_token_graphs:  # batch 1's call traced nothing now
            if self._compiler.compiles:
                raise RuntimeError(
                    "batch 1's graph was compiled before the capture (runner.model called with one token?), "
                    "so its compiles cannot be compared: make a new runner and capture it before any call")
            return graphs[primary]  # Dynamo compiles nothing (TORCH_COMPILE_DISABLE, a force_eager stance)
        failed = failed_on_any_rank(self._compiler.failed, self._group)
        for name in ONE_TOKEN_COMPILES:
            if name not in graphs and name not in failed:
                self._compiler.use = name
                graphs[name] = self._capture_graph(1, md_bs, input_buffers, graph_state, pool, side_stream)
        self._compiler.keep(self._pick_one_token({name: g for name, (g, _) in graphs.items()}))
        if failed:
            self._one_token_stats["failed"] = failed
        return graphs[self._compiler.use]

    def _capture_graph(self, bs: int, md_bs: AttentionMetadata,
                       input_buffers: dict[str, torch.Tensor], graph_state: AttentionState, pool: Any,
                       side_stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, bool]:
        """The static step of `bs` rows captured: (the graph, whether it uploads the metadata)."""
        # Warm up on a side stream, as torch.cuda.graph captures: lazy initialisation (cuBLAS
        # workspaces, Triton compiles, Dynamo's first compile) must not happen during capture.
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream), set_forward_context(md_bs):
            for _ in range(self.warmup_steps):
                warm = self._static_step(bs)
        torch.cuda.current_stream().wait_stream(side_stream)
        if self.feed_back_tokens:
            _check_token_ids(warm)  # before the capture, which an error inside would leave open
        if self._output is None:  # sized by the first (largest) capture
            self._output = torch.empty((bs, *warm.shape[1:]), dtype=warm.dtype, device=warm.device)
        del warm
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        with set_forward_context(md_bs), torch.cuda.graph(graph, pool=pool):
            # The metadata's upload as the graph's first node: a step then writes the State's
            # host mirror and launches, two host calls fewer (GraphState, StaticInputs).
            uploads = graph_state.upload_graph_input_buffers(input_buffers)
            # One output buffer outside the pool: each graph's own output is freed with its other
            # intermediates, so the next (smaller) capture reuses that memory. Keeping every
            # size's output alive instead held 516 of the pool's 590 MiB (35 sizes, vocab 32000).
            self._graph_step(bs, md_bs)
        self._graph_seconds += time.perf_counter() - start
        return graph, uploads

    def _pick_one_token(self, graphs: dict[str, torch.cuda.CUDAGraph]) -> str:
        """The candidate whose batch-1 graph replays fastest; one-token steps run its compile from
        now on. The replays run the capture's all-pad metadata: they write no cache."""
        rounds: dict[str, list[float]] = {name: [] for name in graphs}
        for _ in range(3):  # alternating, so that a change of clocks or neighbours hits both
            for name, graph in graphs.items():
                rounds[name].append(_replay_ms(graph, ONE_TOKEN_TIMED_REPLAYS))
        best = {name: min(ms) for name, ms in rounds.items()}
        agreed = slowest_rank_ms(best, self._group)
        choice = min(agreed, key=agreed.__getitem__)
        self._one_token_stats = {"compile": choice, "replay_ms": best}
        if agreed is not best:
            self._one_token_stats["slowest_rank_ms"] = agreed
        logger.info("batch 1: %s", ", ".join(f"{name} {ms:.3f} ms" for name, ms in best.items()) + f"; kept {choice}")
        return choice

    def _graph_step(self, bs: int, md_bs: AttentionMetadata) -> None:
        """What a decode graph of `bs` rows runs (md_bs: its static metadata): the static step, its
        output written to the output buffer. With feed_back_tokens the positions come first, from
        the static lengths, and the output buffer is the input-id buffer: pad rows (slot -1, no
        cache write) get token 0, so every row the next step may read holds a valid id."""
        if not self.feed_back_tokens:
            self._output[:bs].copy_(self._static_step(bs))
            return
        first = md_bs.first if isinstance(md_bs, GroupedMetadata) else md_bs
        self._positions[:bs].copy_(first.seq_lens_tensor).sub_(1)  # one decode token a row: seq_len - 1
        tokens = self._static_step(bs)
        _check_token_ids(tokens)
        torch.mul(tokens, md_bs.slot_mapping >= 0, out=self._output[:bs])

    def _static_step(self, bs: int) -> torch.Tensor:
        """The model on the first `bs` rows of the static inputs (under the caller's context)."""
        ids, pos = _first_rows(self._input_ids, bs), _first_rows(self._positions, bs)
        self._mark_tokens(ids, pos)
        with floats_as_constants(), self._one_token_calls(bs):
            out = self.model(ids, pos, self.kv_caches)
        # checked at the warm-up, before a capture (which an error inside would leave open), and
        # at every step without CUDA graphs (a replay runs no Python)
        return check_model_output(out, bs)

    def _one_token_calls(self, num_tokens: int) -> contextlib.AbstractContextManager[None]:
        """Around every call of the model: a batch-1 graph Dynamo traces in it gets batch 1's compiles."""
        if num_tokens == 1 and self._pick_batch_one:
            return self._compiler.one_token_calls()
        return contextlib.nullcontext()

    def _mark_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Unbacked token count for a model compiled by the caller (no size recompiles); a model
        the runner compiled keeps it backed (batch 1's own static graph)."""
        if self._unbacked_tokens:
            mark_token_dim(input_ids, positions)

    # -- each step -------------------------------------------------------------------------

    def run(
        self,
        attn_metadata: AttentionMetadata,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        kv_caches: list[torch.Tensor] | None = None,
        *,
        copy_output: bool = True,
    ) -> torch.Tensor:
        """One model step: a replayed graph for a decode-only batch that fits, piecewise graphs
        for another step whose tokens fit (with `piecewise=True`), else eager.

        attn_metadata: from the backend's builder; input_ids, positions: int64 [num_tokens] on
        the spec's device (positions None, and required so, with feed_back_tokens: the runner
        derives them); kv_caches: default the runner's (a graph step checks they are the
        captured tensors). Returns the model output for the step's tokens, [num_tokens, ...],
        a tensor the caller owns (a later step never overwrites it). `counts` records the path.
        copy_output=False: a decode-graph step returns rows of the runner's one output buffer
        instead of a copy, valid until the next decode-graph step rewrites them; it saves a
        device copy and its host call per step (clone what you keep). Other steps return a new
        tensor either way (the piecewise graphs' last output is pool memory no tensor owns).
        """
        if not self.capture_stats:  # set once a capture has finished (a piecewise-only one captures no decode graph)
            raise RuntimeError("call runner.capture() before runner.run()")
        md = attn_metadata
        self._check_inputs(md, input_ids, positions)
        caches = self.kv_caches if kv_caches is None else kv_caches
        path = choose_path(
            num_prefills=md.num_prefills, num_seqs=md.num_seqs,
            max_seq_len=md.longest_seq_len,
            largest_size=self.sizes[0] if self.sizes else 0, max_seq_len_to_capture=self.spec.max_seq_len_to_capture,
            num_tokens=md.num_tokens,
            largest_piecewise_tokens=None if self.piecewise is None else self.piecewise.sizes[0],
        )
        self.counts[path] += 1
        if path != GRAPH and self.feed_back_tokens:
            positions = token_positions(md, input_ids.device)
        if path == PIECEWISE:
            self._check_caches(caches)
            return self.piecewise.run(md, input_ids, positions)
        if path != GRAPH:
            check_cache_list(caches)
            if not isinstance(caches, list):  # a tuple is accepted, but the compiled model's guards would retrace it
                caches = list(caches)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("%s: %d requests, %d prefills, max_seq_len %d", path, md.num_seqs, md.num_prefills,
                             md.max_seq_len)
            if self.piecewise is not None:  # the compiled pieces at the step's own size, no graphs
                return self.piecewise.run_unpadded(md, input_ids, positions, caches)
            self._mark_tokens(input_ids, positions)
            if self._compiler is not None:  # caches other than the runner's may come here
                _mark_static(caches)
            with floats_as_constants(), set_forward_context(md), self._one_token_calls(md.num_tokens):
                return self.model(input_ids, positions, caches)
        self._check_caches(caches)
        n = md.num_seqs
        bs = pick_batch_size(self.sizes, n)
        entry = self._captured[bs, pick_table_width(self.widths, md.max_seq_len, self.spec.block_size)]
        # the step's checks first: a refused step leaves every static buffer as it was
        entry.graph_state.prepare_graph_input_buffers(entry.input_buffers, md, **entry.prepare_kw)
        if not self.feed_back_tokens:
            self._pads_from = fill_padded((self._input_ids, self._positions), (input_ids, positions), self._pads_from)
        elif _leading_rows_of(input_ids, self._input_ids):  # the last step's tokens: in place already
            if n < self._pads_from:  # requests left: their rows become pads (a fill only then)
                self._input_ids[n : self._pads_from].zero_()
            self._pads_from = n
        else:  # other rows of the buffer (a later request's tokens first, say) would overlap their copy
            ids = input_ids.clone() if _shares_storage(input_ids, self._input_ids) else input_ids
            self._pads_from = fill_padded((self._input_ids,), (ids,), self._pads_from)
        entry.graph_state.begin_forward(md)
        if entry.graph is not None:
            entry.graph.replay()
            output = entry.output
        elif self.feed_back_tokens:  # without CUDA graphs: the graph's step, run
            with set_forward_context(entry.metadata):
                self._graph_step(bs, entry.metadata)
            output = self._output[:bs]
        else:
            with set_forward_context(entry.metadata):
                output = self._static_step(bs)
        # A full batch skips the slice, one more host call. The clone ([n, vocab], small next to
        # the step) gives the caller a tensor no later step can change: every graph writes the
        # one output buffer.
        output = output if n == bs else output[:n]
        return output.clone() if copy_output else output

    def _check_inputs(self, md: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor | None) -> None:
        name = self.backend.get_name()
        if not isinstance(md, AttentionMetadata) or getattr(md, "backend_name", None) != name:
            raise ValueError(f"the runner serves {name} metadata, got {type(md).__name__} from another builder")
        device = self._input_ids.device
        if self.feed_back_tokens and positions is not None:
            raise ValueError("this runner derives positions from the metadata (feed_back_tokens=True): call "
                             "run(md, input_ids) without positions")
        if not self.feed_back_tokens and positions is None:
            raise ValueError("positions are required (int64 [num_tokens]), unless the runner derives them: "
                             "CUDAGraphRunner(..., feed_back_tokens=True)")
        for label, t in (("input_ids", input_ids), ("positions", positions)):
            if t is None:  # derived (feed_back_tokens)
                continue
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{label} must be a {INPUT_DTYPE} tensor [num_tokens], got {type(t).__name__}")
            if t.dtype != INPUT_DTYPE or t.device != device or t.dim() != 1:
                raise ValueError(
                    f"{label} must be {INPUT_DTYPE} [num_tokens] on {device} (what the graphs were captured "
                    f"with), got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
            if t.shape[0] != md.num_tokens:
                raise ValueError(f"{label} has {t.shape[0]} tokens but the metadata describes {md.num_tokens}")

    def _check_caches_at_capture(self) -> None:
        device = self._input_ids.device
        for i, cache in enumerate(self.kv_caches):
            if cache.device != device:
                raise ValueError(f"kv_caches[{i}] is on {cache.device}, the spec's device is {device}")
        self._cache_ptrs = [c.data_ptr() for c in self.kv_caches]
        self._cache_numels = [c.numel() for c in self.kv_caches]

    def _check_caches(self, kv_caches: list[torch.Tensor]) -> None:
        # Addresses and sizes: a graph writes the memory it was captured with, at the strides
        # it was captured with, whatever tensor the caller holds now (no device sync). Every
        # step reads them all: the list or a tensor in it may have changed since the last (a new
        # tensor, `set_`, `resize_` in place, which keeps a smaller cache's address); a map over
        # the list costs ~0.1 us a layer, half of a Python loop's. The map checks the elements'
        # type too (`data_ptr` of a non-tensor raises), so `check_cache_list` runs only to name
        # what is wrong.
        try:
            ptrs = list(map(torch.Tensor.data_ptr, kv_caches)) if isinstance(kv_caches, list | tuple) else None
        except TypeError:
            ptrs = None
        if ptrs is None:
            check_cache_list(kv_caches)
        if ptrs != self._cache_ptrs or list(map(torch.Tensor.numel, kv_caches)) != self._cache_numels:
            raise RuntimeError(
                "the KV caches are not the ones the graphs were captured with (reallocated, resized or "
                "replaced): a replay would write the old memory. Make and capture a new CUDAGraphRunner "
                "for the new caches"
            )


def _first_rows(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` elements of a 1-D `buffer`: a tensor of their own over its storage, not a
    view. Dynamo guards a view input's base, so batch 1's static graph, traced on a view, was
    traced and compiled again for the first one-token eager step (its ids no view)."""
    return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(buffer.untyped_storage(), 0, (n,), (1,))


def _mark_static(caches: list[torch.Tensor]) -> None:
    """Mark the caches a runner-compiled model traces with static, where not yet: under
    dynamic=True their sizes would be symbols, and Dynamo's duck sizing ties a token count equal
    to one of them (block size, heads, head size) to it, so the next other size traced again."""
    for cache in caches:
        if not getattr(cache, "_dynamo_static_indices", None):
            torch._dynamo.mark_static(cache)


def _check_token_ids(step_output: torch.Tensor) -> None:
    if (step_output.dtype, step_output.dim()) != (INPUT_DTYPE, 1):
        raise ValueError(f"feed_back_tokens needs a postprocess that returns the next token ids, {INPUT_DTYPE} "
                         f"[num_tokens]; got {step_output.dtype} {tuple(step_output.shape)} "
                         "(e.g. postprocess=lambda logits: logits.argmax(-1))")


def _shares_storage(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    return t.device == buffer.device and t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def _leading_rows_of(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `t` is the first t.shape[0] rows of 1-D `buffer` (a view at its start, or one made
    by `_first_rows`): copying it there would copy nothing."""
    return (t.data_ptr() == buffer.data_ptr() and t.dtype == buffer.dtype and t.device == buffer.device
            and (t.shape[0] <= 1 or t.stride(0) == 1))


def token_positions(md: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """Each token's position in its sequence, int64 [num_tokens] on `device`: request i's
    query_lens[i] tokens sit at seq_lens[i] - query_lens[i] .. seq_lens[i] - 1, in request order."""
    first = md.first if isinstance(md, GroupedMetadata) else md
    seq, query = np.asarray(first.seq_lens, dtype=np.int64), np.asarray(first.query_lens, dtype=np.int64)
    _, positions = token_positions_of(seq - query, seq)
    return torch.from_numpy(positions).to(device, non_blocking=True)


def _replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds a replay of `graph`, over `replays` in a row after one untimed."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


@contextlib.contextmanager
def _own_cublas_workspace(cuda: bool) -> Iterator[None]:
    """Captured matmuls keep the address of cuBLAS's cached workspace for the capture stream.
    Dropped before capture, that workspace is allocated again inside this runner's pool, which
    lives as long as its graphs; dropped after, no later capture elsewhere reuses it. Otherwise
    it may sit in an older graph's pool, and when PyTorch's cudagraph trees
    (`mode="reduce-overhead"`) clear the cache the same way, that memory can be released under
    these graphs. The same private call Inductor's cudagraph trees make."""
    if cuda:
        torch._C._cuda_clearCublasWorkspaces()
    try:
        yield
    finally:
        if cuda:
            torch._C._cuda_clearCublasWorkspaces()


def _original(model: ModelStep) -> ModelStep:
    """The eager callable behind a `torch.compile` result (module or function), else `model`."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return model._orig_mod
    return getattr(model, "_torchdynamo_orig_callable", model)


def _progress(graphs: Iterable[tuple[int, int]], enabled: bool, desc: str) -> Iterator[tuple[int, int]]:
    """A tqdm bar over the (size, width) graphs to capture, if tqdm is installed and `enabled`."""
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            logger.info("%s (install tqdm for a progress bar)", desc)
        else:
            yield from tqdm(graphs, desc=desc, unit="graph")
            return
    yield from graphs


def _pool_bytes(pool: Any, device: torch.device) -> int | None:
    """Bytes of the segments the graph pool holds (from the allocator's snapshot), or None if
    this torch's snapshot does not name pools."""
    want = tuple(pool)
    segments = torch.cuda.memory_snapshot()
    if not segments or "segment_pool_id" not in segments[0]:
        return None
    return sum(
        s["total_size"] for s in segments
        if tuple(s["segment_pool_id"]) == want and s.get("device", device.index) == device.index
    )


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:.1f} MiB"



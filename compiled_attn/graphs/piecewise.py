"""Piecewise CUDA graphs: prefill and mixed steps replayed as graphs, attention run eagerly.

A decode graph captures attention too, which works because every decode row has one token and
the State refills fixed-size metadata buffers. A step with prompts has no such fixed shape, so
here the model is compiled once (`fullgraph=True`) by a Dynamo backend that cuts its graph at
the ops that read the forward context (`split.split_at_context_ops`: the cache write and the
attention op of every layer). Each piece between them is compiled by Inductor for a symbolic
token count and captured as one CUDA graph per token-count bucket, all into one memory pool;
the ops run eagerly between the replays with the step's own metadata. With CUDA graphs a
DECODER layer's cache write stays inside its piece and is captured with it
(`split.is_captured_write`): it reads the bucket's static slot buffer, which each step fills with
its slots (pads -1), so a layer costs one eager op (attention) and one replay.

A step of n tokens runs in the smallest bucket b >= n: ids, positions (and slots) are copied
into static buffers whose rows n..b-1 are pads (zeros; slot -1). The pieces compute all b rows;
an op between them gets its token rows cut to the step's n (`EagerOps`), and a captured write
skips the pad slots, so pad rows write no cache and are never attended to, and the pad rows of
`output` keep whatever the pool held. Every piece is row-wise
outside attention (a token's output depends on its own row and attention only), so pad rows
never reach a live row; their outputs are dropped.

Captured pieces hand their outputs to the next piece by address: at capture the outputs are
real tensors (the pool frees each when the capture forward drops it, exactly as a replay would
stop reading it); for replay each piece keeps non-owning views of them (vLLM's scheme), so a
bucket's intermediates share pool memory with every other bucket's instead of living on.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_map_only

from compiled_attn.abstract import AttentionMetadata
from compiled_attn.dynamo import mark_token_dim
from compiled_attn.forward_context import capturing_pieces, get_forward_context, get_layer, set_forward_context
from compiled_attn.graphs.buckets import fill_padded, pick_batch_size
from compiled_attn.graphs.split import (
    Piece,
    is_captured_write,
    is_context_op,
    is_eager_op,
    split_at_context_ops,
)
from compiled_attn.groups import GroupedMetadata
from compiled_attn.ops.library import python_kernel
from compiled_attn.validation import (
    METADATA_KINDS_KEPT,
    CapturedWrite,
    check_captured_writes,
    check_model_output,
    metadata_kind,
)

logger = logging.getLogger(__name__)

PIECE_COMPILERS = ("inductor", "eager")


@dataclasses.dataclass
class GraphControl:
    """What the pieces of one compiled model do on this call; set by `PiecewiseGraphs` only.

    bucket: the padded token count whose graphs serve the call, or None (run the pieces as
    compiled, at the call's own token count). capturing: capture a graph per piece for
    `bucket`. skip_ops: the ops between pieces do nothing (warm-up and capture: no step, no
    metadata; what they would write is don't-care there).
    """

    use_graphs: bool
    bucket: int | None = None
    capturing: bool = False
    skip_ops: bool = False
    pool: Any = None  # the CUDA graph pool every piece captures into

    @contextlib.contextmanager
    def serving(self, bucket: int | None, *, capturing: bool = False, skip_ops: bool = False) -> Iterator[None]:
        saved = (self.bucket, self.capturing, self.skip_ops)
        self.bucket, self.capturing, self.skip_ops = bucket, capturing, skip_ops
        try:
            yield
        finally:
            self.bucket, self.capturing, self.skip_ops = saved


class CapturedPiece:
    """A compiled piece, captured once per bucket and replayed; or just run (no bucket, or no
    CUDA graphs)."""

    def __init__(self, runnable: Callable[..., Any], control: GraphControl) -> None:
        self.runnable = runnable
        self.control = control
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}  # bucket -> (graph, non-owning outputs)

    def __call__(self, *args: Any) -> Any:
        control = self.control
        if not control.use_graphs or control.bucket is None:
            return self.runnable(*args)
        if control.capturing:
            graph, outputs = capture_graph(self.runnable, args, control.pool)
            self.graphs[control.bucket] = (graph, tree_map_only(torch.Tensor, non_owning, outputs))
            return outputs  # owning: the pool frees them when the capture forward drops them
        captured = self.graphs.get(control.bucket)
        if captured is None:
            raise RuntimeError(f"no piecewise graph for {control.bucket} tokens: call capture() before run()")
        graph, outputs = captured
        graph.replay()
        return outputs


def capture_graph(fn: Callable[..., Any], args: tuple[Any, ...], pool: Any) -> tuple[Any, Any]:
    """`fn(*args)` captured on the current stream into a new CUDA graph in `pool`: (the graph,
    the outputs the capture allocated).

    capture_begin / capture_end rather than `torch.cuda.graph`, which synchronizes, collects
    garbage and empties the allocator's cache before every capture: hundreds of pieces' worth.
    The caller runs the capture forward on a side stream (capture cannot use the default one).
    """
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool)
    try:
        outputs = fn(*args)
    finally:
        graph.capture_end()
    return graph, outputs


class EagerOps:
    """A group of context ops, run eagerly between pieces with the step's metadata. Arguments
    whose first dimension is the (padded) token count are cut to the step's tokens. The ops are
    called as their Python kernels (`ops.library.python_kernel`): the dispatcher's call adds
    3.5 us per op with their six arguments (H200 host, `bench` suite `overhead`), once or twice
    per layer and step, and does nothing else for these ops outside a trace (one
    CompositeExplicitAutograd kernel, no autograd)."""

    def __init__(self, module: fx.GraphModule, token_args: tuple[int, ...], control: GraphControl) -> None:
        direct = fx.GraphModule(module, copy.deepcopy(module.graph))  # `module` stays as split (the pieces)
        names = []
        for node in direct.graph.nodes:
            if is_context_op(node):
                node.target = python_kernel(node.target)
                names += [a for a in node.args if isinstance(a, str)]
        direct.recompile()
        # The group's layers, kept alive: the group runs with no Dynamo guard, and a dead layer's
        # name goes to the next layer of its kind (`forward_context.register_layer`), so a model
        # whose layers were replaced would otherwise run these ops with the new layers' options.
        self._layers = [get_layer(name) for name in names]
        # the group's generated code, called directly: GraphModule's __call__ wraps it in ~3 us of
        # error handling and module hooks per call, once per layer and step
        self._forward = direct.forward
        self.token_args = token_args
        self.control = control

    def __call__(self, *args: Any) -> Any:
        if self.control.skip_ops:
            return ()
        num_tokens = get_forward_context().attn_metadata.num_tokens
        if any(args[i].shape[0] != num_tokens for i in self.token_args):
            args = tuple(a[:num_tokens] if i in self.token_args else a for i, a in enumerate(args))
        return self._forward(*args)


class PiecewiseBackend:
    """A Dynamo backend: split the graph at the context ops, compile each piece, wrap pieces
    (`CapturedPiece`) and op groups (`EagerOps`) around `control`.

    piece_compiler: "inductor" (`compile_fx` per piece, for a symbolic token count) or "eager"
    (the FX pieces as they are: fast to build, for tests of the splitting and padding).
    captures_writes: leave DECODER layers' cache writes inside the pieces (`split.is_eager_op`);
    `writes` then describes each (`validation.CapturedWrite`), in order. Only for captured
    pieces: run as they are, padded, such a write would read the step's metadata with the
    bucket's rows.
    """

    def __init__(self, control: GraphControl, piece_compiler: str = "inductor",
                 options: dict[str, Any] | None = None, captures_writes: bool = False) -> None:
        if piece_compiler not in PIECE_COMPILERS:
            raise ValueError(f"piece_compiler must be one of {PIECE_COMPILERS}, got {piece_compiler!r}")
        self.control = control
        self.piece_compiler = piece_compiler
        self.options = dict(options or {})
        self.is_op = is_eager_op if captures_writes else is_context_op  # what runs eagerly between pieces
        self.writes: list[CapturedWrite] = []  # the cache writes the last compile's pieces capture
        self.num_compiles = 0  # Dynamo graphs handed to this backend: 1 unless something recompiled
        self.split_module: fx.GraphModule | None = None
        self.pieces: list[Piece] = []
        self.compile_seconds = 0.0
        # bucket -> (split module, the flat inputs Dynamo called it with, id of its one output or
        # None, the writes its pieces capture)
        self.recorded: dict[int, tuple[fx.GraphModule, tuple[Any, ...], int | None, WriteChecks]] = {}

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        self.num_compiles += 1
        # Dynamo's fake values, symbolic token count included (example_inputs are the real tensors).
        fake_inputs = [node.meta["example_value"] for node in gm.graph.find_nodes(op="placeholder")]
        split, pieces = split_at_context_ops(gm, self.is_op)
        self.writes = captured_writes(gm, example_inputs) if self.is_op is is_eager_op else []
        token_counts = [t.shape[0] for t in fake_inputs
                        if isinstance(t, torch.Tensor) and t.dim() and isinstance(t.shape[0], torch.SymInt)]
        fake_mode = next(t.fake_mode for t in fake_inputs if isinstance(t, FakeTensor))
        with fake_mode:
            _CompilePieces(split, self, token_counts).run(*fake_inputs)
        self.split_module, self.pieces = split, pieces
        seconds = time.perf_counter() - start
        self.compile_seconds += seconds
        logger.info("piecewise: %d pieces, %d op groups (compiled with %s in %.1f s)",
                    sum(not p.is_op_group for p in pieces), sum(p.is_op_group for p in pieces),
                    self.piece_compiler, seconds)
        return self._recording(split, WriteChecks(self.writes))

    def _recording(self, split: fx.GraphModule, writes: WriteChecks) -> Callable[..., Any]:
        """`split`, recording the flat inputs of a call made for a bucket (`PiecewiseGraphs` then
        calls `split` with them directly: no guards to evaluate per step) and the writes its
        pieces capture (a recompile's pieces may write other caches)."""
        control = self.control

        def call(*args: Any) -> Any:
            outputs = split(*args)
            if control.bucket is not None:
                one = isinstance(outputs, tuple | list) and len(outputs) == 1
                self.recorded[control.bucket] = (split, args, id(outputs[0]) if one else None, writes)
            return outputs

        return call

    def compile_piece(self, module: fx.GraphModule, args: Sequence[Any]) -> Callable[..., Any]:
        if self.piece_compiler == "eager":
            return module
        from torch._inductor.compile_fx import compile_fx  # imports Inductor: only when compiling with it

        return compile_fx(module, list(args), config_patches=self.options)


@dataclasses.dataclass
class WriteChecks:
    """The cache writes one compile's pieces capture, and the metadata kinds (`validation.
    metadata_kind`) every one of them was checked against in full."""

    writes: list[CapturedWrite]
    kinds: set[Any] = dataclasses.field(default_factory=set)


def captured_writes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[CapturedWrite]:
    """Each cache write of `gm` that the pieces capture: its layer, its query's and keys' dtype
    and trailing shapes (Dynamo's fake values) and the cache it writes (the real tensor Dynamo
    was called with for that placeholder)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    writes = []
    for node in gm.graph.nodes:
        if is_captured_write(node):
            query, key, cache = node.args[0].meta["example_value"], node.args[1].meta["example_value"], node.args[3]
            if cache.op != "placeholder":
                raise NotImplementedError(f"a cache write of {node.args[-1]} writes a cache that is not a model "
                                          "input: piecewise graphs capture writes into the caches passed to the model")
            writes.append(CapturedWrite(get_layer(node.args[-1]), query.dtype, tuple(query.shape[1:]),
                                        tuple(key.shape[1:]), example_inputs[placeholders.index(cache)]))
    return writes


class _CompilePieces(fx.Interpreter):
    """Runs the split module on Dynamo's fake inputs; at each submodule, compiles it with the fake
    arguments it receives there and puts its wrapper in its place."""

    def __init__(self, split: fx.GraphModule, backend: PiecewiseBackend, token_counts: list[torch.SymInt]) -> None:
        super().__init__(split)
        self.split, self.backend, self.token_counts = split, backend, token_counts

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module = getattr(self.split, target)
        outputs = module(*args, **kwargs)  # fake: shapes for the next pieces
        if any(self.backend.is_op(node) for node in module.graph.nodes):  # an op group
            if outputs not in ((), None):
                raise NotImplementedError(f"ops between pieces must return nothing (they write their `output` "
                                          f"argument); {target} returns {type(outputs).__name__}")
            token_args = tuple(i for i, a in enumerate(args) if self._has_token_rows(a))
            if not token_args:  # padded rows would reach the ops, which refuse them every step
                raise NotImplementedError(
                    f"no argument of the ops in {target} has the token count as its first dimension (token "
                    f"counts {self.token_counts}): piecewise graphs need the model's token dimension marked "
                    "(the runner marks input_ids / positions) and reaching the ops"
                )
            wrapper: Any = EagerOps(module, token_args, self.backend.control)
        else:
            wrapper = CapturedPiece(self.backend.compile_piece(module, args), self.backend.control)
        # The instance attribute shadows the registered submodule, so the split module's code
        # calls the wrapper (a plain callable: no nn.Module call overhead per piece).
        self.split.__dict__[target] = wrapper
        return outputs

    def _has_token_rows(self, arg: Any) -> bool:
        if not isinstance(arg, torch.Tensor) or not arg.dim():
            return False
        rows = arg.shape[0]
        return isinstance(rows, torch.SymInt) and any(statically_known_true(rows == n) for n in self.token_counts)


def non_owning(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s memory that does not keep it allocated: a captured piece's output, read at
    replay at the address the capture gave it, while the pool may lend that memory to other
    buckets' captures (only one bucket replays at a time)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.size(), t.stride())


class PiecewiseGraphs:
    """The model compiled once and cut at the context ops, its pieces captured per token bucket.

    Args:
        model: the eager step, `model(input_ids, positions, kv_caches) -> [num_tokens, ...]`.
        kv_caches: the caches the model writes (passed through each call).
        sizes: token buckets, largest first (`buckets.piecewise_sizes_for`).
        device: where the static input buffers live.
        use_cuda_graphs: False runs the padded pieces without capture (CPU; debugging).
        piece_compiler: "inductor" or "eager" (`PiecewiseBackend`).
        options: Inductor config patches for every piece.
        warmup_steps: runs per bucket before its capture (compile, lazy initialisation, autotuning).

    `capture(pool)` compiles and captures every bucket; `run(md, input_ids, positions)` serves a
    step of at most `sizes[0]` tokens in its bucket, `run_unpadded` any step at its own size
    with the same compiled pieces and no graphs. `CUDAGraphRunner(piecewise=True)` is the
    user-facing way; this class is its piecewise half (the bench forces a decode through it).

    Example::

        graphs = PiecewiseGraphs(model, kv_caches, sizes=[64, 32, 16], device=torch.device("cuda"),
                                 use_cuda_graphs=True)
        graphs.capture(torch.cuda.graph_pool_handle())
        logits = graphs.run(md, input_ids, positions)   # md.num_tokens <= 64: [num_tokens, vocab]
    """

    def __init__(self, model: Callable[..., torch.Tensor], kv_caches: list[torch.Tensor], *, sizes: list[int],
                 device: torch.device, use_cuda_graphs: bool, piece_compiler: str = "inductor",
                 options: dict[str, Any] | None = None, warmup_steps: int = 2) -> None:
        self.control = GraphControl(use_graphs=use_cuda_graphs)
        # with graphs, the cache writes are captured in the pieces (over the static slots below)
        self.backend = PiecewiseBackend(self.control, piece_compiler, options, captures_writes=use_cuda_graphs)
        # dynamic=False: only the token count (marked unbacked each call) is symbolic; the cache and
        # weight shapes stay static, so Inductor specialises every kernel to them.
        self.compiled = torch.compile(model, backend=self.backend, fullgraph=True, dynamic=False)
        self.kv_caches = kv_caches if isinstance(kv_caches, list) else list(kv_caches)  # as CUDAGraphRunner's
        self.sizes = sizes
        self.warmup_steps = warmup_steps
        self.capture_stats: dict[str, Any] = {}
        # bucket -> (split module, its flat inputs, the writes its pieces capture): the step
        # without Dynamo (`_bucket_step`)
        self._direct: dict[int, tuple[fx.GraphModule, tuple[Any, ...], WriteChecks]] = {}
        top = sizes[0]
        # static model inputs; zeros are a valid token id and position for any model
        self._input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self._positions = torch.zeros(top, dtype=torch.int64, device=device)
        self._slots = torch.full((top,), -1, dtype=torch.int64, device=device)  # what captured writes read
        self._pads_from = 0  # rows of these buffers from here on hold pads (`fill_padded`)

    @property
    def captures_writes(self) -> bool:
        return self.backend.is_op is is_eager_op

    def capture(self, pool: Any = None) -> dict[str, Any]:
        """Compile (at the first warm-up) and capture every bucket, largest first, into `pool`;
        returns capture_stats (sizes, num_pieces, num_op_groups, num_graphs, compile_seconds,
        seconds, graph_seconds)."""
        control, cuda = self.control, self.control.use_graphs
        control.pool = pool
        self._slots.fill_(-1)  # warm-up and capture run the captured writes: over pads only
        device = self._input_ids.device
        # Two side streams: capture cannot use the default stream, and it must not use the warm-up's
        # either. cuBLAS keeps one workspace per stream; made during the warm-up it would come from
        # the ordinary allocator and be freed when the runner clears the workspaces after capture,
        # under the graphs. Made during the first captured matmul, it lives in the graphs' pool.
        on_cuda = cuda and device.type == "cuda"
        warm_stream = torch.cuda.Stream(device) if on_cuda else None
        capture_stream = torch.cuda.Stream(device) if on_cuda else None
        start, graph_seconds = time.perf_counter(), 0.0
        for bucket in self.sizes:
            # Without graphs one warm-up compiles everything (the token count is symbolic).
            warmups = self.warmup_steps if cuda else int(bucket == self.sizes[0])
            with _on(warm_stream), control.serving(None, skip_ops=True), self._capturing(bucket):
                for _ in range(warmups):  # the compiled pieces, for real
                    self._static_step(bucket)
            if cuda:
                if on_cuda:
                    capture_stream.wait_stream(warm_stream)
                started = time.perf_counter()
                with _on(capture_stream), control.serving(bucket, capturing=True, skip_ops=True), \
                        self._capturing(bucket):
                    self._bucket_step(bucket)  # its output dies here: the pool reuses it
                graph_seconds += time.perf_counter() - started
        if on_cuda:
            torch.cuda.current_stream().wait_stream(capture_stream)
        pieces = [p for p in self.backend.pieces if not p.is_op_group]
        self.capture_stats = {
            "sizes": list(self.sizes),
            "num_pieces": len(pieces),
            "num_op_groups": len(self.backend.pieces) - len(pieces),
            "num_graphs": len(pieces) * len(self.sizes) if cuda else 0,
            "compile_seconds": self.backend.compile_seconds,
            "seconds": time.perf_counter() - start,
            "graph_seconds": graph_seconds,  # in the capture forwards only (no warm-up, no compile)
        }
        return self.capture_stats

    def _capturing(self, bucket: int) -> contextlib.AbstractContextManager:
        """The forward context of a bucket's warm-up and capture: the writes the pieces capture
        read the bucket's static slots (pads: nothing is written). Without captured writes, none
        (the ops are skipped)."""
        return capturing_pieces(self._slots[:bucket]) if self.captures_writes else contextlib.nullcontext()

    def _static_step(self, bucket: int) -> torch.Tensor:
        """The model on the first `bucket` rows of the static inputs, its output checked (at the
        warm-up: before any piece of the bucket is captured)."""
        ids, pos = self._input_ids[:bucket], self._positions[:bucket]
        return check_model_output(self._call(ids, pos, self.kv_caches), bucket)

    def _bucket_step(self, bucket: int) -> torch.Tensor:
        """The model on the static inputs of `bucket` (under the caller's `control.serving`).

        The first call goes through Dynamo and records the flat inputs it hands the split module
        (weights, the static input buffers' views, the caches, the token count: the same objects
        every step); later calls pass them to the split module directly. Dynamo's guards, some
        hundreds of microseconds per call for an 8B-sized model, are skipped: they check the
        inputs, which are these very tensors, and global state, which the pieces (captured, or
        compiled for these inputs) and the eager ops do not read. The model must return one
        tensor, with no Python side effects outside its graph (a `fullgraph=True` step is one).
        """
        direct = self._direct.get(bucket)
        if direct is not None:
            split, args, _ = direct
            with torch.no_grad():
                return split(*args)[0]
        output = self._static_step(bucket)
        split, args, output_id, writes = self.backend.recorded.pop(bucket)
        if output_id != id(output):
            raise ValueError("piecewise graphs serve a model whose forward returns its compiled graph's one output "
                             "tensor, with no Python after it (compile it with fullgraph=True)")
        self._direct[bucket] = (split, args, writes)
        return output

    def _call(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        # Always under no_grad: Dynamo guards on grad mode; a caller's other mode would recompile.
        mark_token_dim(input_ids, positions)
        with torch.no_grad():
            return self.compiled(input_ids, positions, kv_caches)

    def run(self, md: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step (md.num_tokens <= sizes[0]) padded to its bucket: replayed pieces, eager ops.
        Returns the output rows of the step's tokens, a tensor the caller owns. With captured
        writes the step is first checked as their ops would check it (`check_captured_writes`):
        nothing runs for them at replay."""
        n = md.num_tokens
        bucket = pick_batch_size(self.sizes, n)
        if bucket is None:
            raise ValueError(f"{n} tokens > the largest piecewise bucket {self.sizes[0]}: use run_unpadded")
        if input_ids.shape[0] != n or positions.shape[0] != n:  # every buffer is filled by these rows
            raise ValueError(f"input_ids / positions have {input_ids.shape[0]} / {positions.shape[0]} rows but the "
                             f"metadata describes {n} tokens")
        direct = self._direct.get(bucket)
        writes = None if direct is None else direct[2]
        buffers, sources, pads = (self._input_ids, self._positions), (input_ids, positions), None
        if writes is not None and writes.writes:  # none: no graphs, or every layer grouped, say
            buffers, sources = (*buffers, self._slots), (*sources, self._checked_slots(md, writes))
            pads = (0, 0, -1)
        self._pads_from = fill_padded(buffers, sources, self._pads_from, pads)
        with set_forward_context(md), self.control.serving(bucket):
            output = self._bucket_step(bucket)
        # Clone: the last piece's output is pool memory, not owned by any tensor (a non-owning
        # view), that any later replay sharing the pool may rewrite.
        return output[:n].clone()

    def _checked_slots(self, md: AttentionMetadata, checks: WriteChecks) -> torch.Tensor:
        """The slots the captured writes read this step, after what each write's op would check
        of the step before writing, since nothing runs for those writes at replay: in full
        (every layer, stand-in tensors of the step's rows) the first time these writes meet a
        kind of metadata (`validation.metadata_kind`, as the ops remember kinds), then only the
        slot mapping's rows. (The caches' addresses and sizes: `CUDAGraphRunner` every step.)"""
        step = md.for_group(None) if isinstance(md, GroupedMetadata) else md  # one group, else the layers' error
        kind = metadata_kind(step)
        if kind is None or kind not in checks.kinds:
            check_captured_writes(step, checks.writes)
            if kind is not None:
                if len(checks.kinds) >= METADATA_KINDS_KEPT:
                    checks.kinds.clear()
                checks.kinds.add(kind)
        slots = step.slot_mapping
        if slots.shape != (step.num_tokens,):
            raise ValueError(f"the metadata's slot_mapping has shape {tuple(slots.shape)}, its tokens are "
                             f"{step.num_tokens}: build the metadata with the backend's builder")
        return slots

    def run_unpadded(self, md: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The step at its own token count through the compiled pieces, no graphs (any size);
        kv_caches: default the ones given at construction."""
        with set_forward_context(md), self.control.serving(None):
            return self._call(input_ids, positions, self.kv_caches if kv_caches is None else kv_caches)


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run on `stream` (waiting for the current stream's work first), or where we are if None.
    Warm-up and capture run on a side stream: capture cannot use the default stream, and lazy
    initialisation must happen where it will not be captured."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield

"""Serve Hugging Face `transformers` causal LMs on paged KV caches, compiled, with CUDA graphs.

    from compiled_attn.integrations import transformers as ca_hf
    ca_hf.register()                                  # attn_implementation="compiled_attn" is valid now
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="compiled_attn")
    engine = ca_hf.PagedEngine(model, block_size=16, num_blocks=1024)
    new_tokens = engine.generate(prompts, max_new_tokens=8)   # list[list[int]] in, new tokens out

How it fits: transformers calls the registered attention function with the layer's module and
its (rotated) query / key / value. `PagedEngine` gives every attention module a `ca.Attention`
(its heads, head size, scale, window and soft-cap read from the module itself), groups the layers
whose settings are equal (one `AttentionSpec`, builder and graph State per group), owns the
caches, the `paging.Scheduler` and the `CUDAGraphRunner`, and feeds the model a flat batch:
input_ids / position_ids [1, num_tokens], the caches as a keyword that transformers passes
through to the attention function. The step's metadata reaches the ops through the forward
context (one per group), never through the model's arguments, so the model compiles to one graph.
Masks are not built: this implementation is not in transformers' mask registry, so its mask
functions return None, and causality, windows and request boundaries come from the metadata.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import torch
from torch import nn

import compiled_attn as ca
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.graphs.buckets import names_no_sizes
from compiled_attn.graphs.runner import WithPostprocess
from compiled_attn.groups import GroupedMetadata, GroupedState
from compiled_attn.paging import NULL_BLOCK, ScheduledStep, Scheduler, ServedRequest, window_blocks
from compiled_attn.registry import BACKEND_CLASSES, ENV_VAR
from compiled_attn.validation import as_int

IMPLEMENTATION = "compiled_attn"  # the attn_implementation name register() adds
LAYER_ATTR = "compiled_attn"  # the ca.Attention an engine attaches to each attention module
SINK_KWARGS = ("s_aux", "sinks")  # the attention function's keywords for per-head sink logits (gpt-oss: s_aux)
CACHES_KWARG = "compiled_attn_kv_caches"  # the model keyword carrying the caches to the attention function


def register() -> None:
    """Make `attn_implementation="compiled_attn"` valid in transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the module's `ca.Attention`.

    query [1, num_heads, num_tokens, head_size], key / value [1, num_kv_heads, num_tokens,
    head_size] (the flat batch of one engine step); returns [1, num_tokens, num_heads,
    head_size]. The scale, window and soft-cap transformers passes are the layer's own: they
    must equal what the engine read (checked while tracing: Python constants, no cost per step).
    """
    layer = getattr(module, LAYER_ATTR, None)
    caches = kwargs.get(CACHES_KWARG)
    if layer is None or caches is None:
        raise RuntimeError(f"attn_implementation={IMPLEMENTATION!r} runs inside compiled_attn's PagedEngine (which "
                           "owns the caches and the step's metadata); call engine.generate / engine.step")
    _check_call_settings(layer, scaling, sliding_window, softcap)
    # transformers builds no mask for an implementation without a mask function, so a mask here
    # came from the model or its caller (chunked, bidirectional or padded attention): the paged
    # step attends causally within each request (and its window) only, and would ignore it.
    if attention_mask is not None:
        raise ValueError(f"layer {module.layer_idx} was given an attention mask {tuple(attention_mask.shape)}: "
                         "PagedEngine serves causal attention per request (with the layer's window) only")
    if dropout:
        raise ValueError(f"attention dropout {dropout} (a model in training mode?): call model.eval() first")
    sinks = [name for name in SINK_KWARGS if kwargs.get(name) is not None]
    if sinks:  # layer_settings refuses the modules known to keep them; this catches the rest
        raise ValueError(f"layer {module.layer_idx} was given attention sinks ({sinks[0]}): PagedEngine's kernels "
                         "have none")
    _, num_heads, num_tokens, head_size = query.shape
    q = query[0].transpose(0, 1).reshape(num_tokens, num_heads * head_size)
    k = key[0].transpose(0, 1).reshape(num_tokens, -1)
    v = value[0].transpose(0, 1).reshape(num_tokens, -1)
    out = layer(q, k, v, caches[module.layer_idx])  # [num_tokens, num_heads * head_size]
    return out.view(1, num_tokens, num_heads, head_size), None


def _check_call_settings(layer: ca.Attention, scaling: float | None, sliding_window: int | None,
                         softcap: float | None) -> None:
    impl = layer.impl
    scale = impl.head_size**-0.5 if scaling is None else scaling
    # plain arithmetic: Dynamo folds it at trace time (math.isclose is not traceable)
    if (abs(scale - impl.scale) > 1e-6 * impl.scale or sliding_window != impl.sliding_window
            or softcap != impl.logits_soft_cap):
        raise ValueError(
            f"transformers calls this layer with scaling={scaling}, sliding_window={sliding_window}, softcap={softcap}"
            f" but the engine read scale={impl.scale}, sliding_window={impl.sliding_window}, logits_soft_cap="
            f"{impl.logits_soft_cap} from the module: teach layer_settings() where this model keeps them"
        )


# ---------------------------------------------------------------------------------------------
# What each layer needs, read from the model


@dataclasses.dataclass(frozen=True)
class LayerSettings:
    """Everything that makes two layers' attention plan differently (one group per distinct value)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    logits_soft_cap: float | None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention modules in layer order (those with a `layer_idx` and q_proj)."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    if not found:
        raise ValueError(f"found no attention modules (with layer_idx and q_proj) in {type(model).__name__}")
    found.sort(key=lambda m: m.layer_idx)
    if [m.layer_idx for m in found] != list(range(len(found))):
        raise ValueError(f"attention layer indices {[m.layer_idx for m in found]} are not 0..{len(found) - 1}")
    return found


def layer_settings(module: nn.Module) -> LayerSettings:
    """A layer's settings from its module: heads from its config, `head_dim`, `scaling` (Gemma2:
    query_pre_attn_scalar ** -0.5), `sliding_window` (per layer for Qwen2 / Gemma2; Mistral
    keeps one for every layer in its config) and `attn_logit_softcapping` (Gemma2)."""
    config = module.config
    if not getattr(module, "is_causal", True):
        raise ValueError(f"layer {module.layer_idx} is not causal: PagedEngine serves decoder-only causal LMs")
    # a layer type transformers expresses by its mask alone (Llama4's chunked attention, say): no
    # mask reaches this implementation (it has no mask function), so it would attend causally
    layer_types = getattr(config, "layer_types", None)
    kind = layer_types[module.layer_idx] if isinstance(layer_types, list | tuple) else None
    if kind not in (None, "full_attention", "sliding_attention"):
        raise ValueError(f"layer {module.layer_idx} is a {kind!r} layer: PagedEngine serves full and "
                         "sliding-window causal attention only")
    if getattr(module, "sinks", None) is not None:  # gpt-oss: passed as `s_aux`, which no kernel here takes
        raise ValueError(f"layer {module.layer_idx} has attention sinks: PagedEngine's kernels have none")
    window = module.sliding_window if hasattr(module, "sliding_window") else getattr(config, "sliding_window", None)
    return LayerSettings(
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_size=module.head_dim,
        scale=float(module.scaling),
        sliding_window=None if window is None else int(window),
        logits_soft_cap=getattr(module, "attn_logit_softcapping", None),
    )


@dataclasses.dataclass
class LayerGroup:
    """Layers of equal settings: one spec, one builder, one graph State, one block table per request."""

    name: str
    settings: LayerSettings
    layers: list[int]
    spec: ca.AttentionSpec


def group_name(settings: LayerSettings, taken: set[str]) -> str:
    """A readable name ("full", "window4096"), made unique: it keys metadata, tables and logs."""
    name = "full" if settings.sliding_window is None else f"window{settings.sliding_window}"
    return name if name not in taken else f"{name}.{len(taken)}"


# ---------------------------------------------------------------------------------------------
# The engine


@dataclasses.dataclass
class RequestOutput:
    """What a request produced so far: one object per request, updated in place by every step
    (`output_tokens` and `logits` grow; copy them to keep a snapshot). `logits`: per new token,
    fp32 [vocab] on the CPU (only with `PagedEngine(keep_logits=True)`)."""

    request_id: int
    prompt: list[int]
    output_tokens: list[int]
    finished: bool
    finish_reason: str | None  # "eos", "length" or None while running
    logits: list[torch.Tensor] | None = None


class _ModelStep(nn.Module):
    """The step the runner serves: a flat batch through the transformers model, logits out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                         **{CACHES_KWARG: kv_caches})
        return out.logits[0]  # [num_tokens, vocab]


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


class PagedEngine:
    """Continuous batching of a transformers causal LM over paged KV caches.

    Args:
        model: loaded with `attn_implementation="compiled_attn"` (after `register()`), on the
            device and in the dtype to serve in. Put in eval mode; its attention modules get a
            `ca.Attention` each (no parameters).
        block_size, num_blocks: cache geometry (blocks per layer; block 0 is reserved and kept
            zero). A sliding-window group's caches hold fewer where its window allows: at most
            max_batch_size requests, each holding `paging.window_blocks(W, max_num_batched_tokens,
            block_size)` blocks (its tables roll), so its KV memory does not grow with context.
        backend: a backend name, or None for the first (FLASHINFER > XFORMERS > TORCH_SDPA)
            that serves every group.
        compile: `torch.compile(fullgraph=True, dynamic=True)` the model step.
        cuda_graphs: serve decode steps through `CUDAGraphRunner` (captured graphs on CUDA; on
            the CPU its same padded static-buffer step without capture).
        max_batch_size: the most requests in one step, and the largest captured graph.
        max_num_batched_tokens: the most tokens in one step (longer prompts are chunked).
        keep_logits: keep each new token's logits in the outputs (fp32, CPU); otherwise the
            greedy argmax runs inside the step and the logits never leave the device.
        max_seq_len_to_capture: the longest sequence a decode graph serves (longer run eagerly).
        capture_sizes: the runner's batch sizes (default: its own up to max_batch_size).

    Example::

        engine = PagedEngine(model, block_size=16, num_blocks=2048)
        engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=8)   # -> [[...8 ids], [...8 ids]]
        rid = engine.add_request([1, 2, 3], max_new_tokens=4)    # or serve step by step
        while engine.has_unfinished():
            for out in engine.step(): ...
    """

    def __init__(
        self,
        model: nn.Module,
        block_size: int = 16,
        num_blocks: int = 1024,
        backend: str | None = None,
        compile: bool = True,
        cuda_graphs: bool = True,
        max_batch_size: int = 64,
        *,
        max_num_batched_tokens: int = 2048,
        keep_logits: bool = False,
        max_seq_len_to_capture: int = 8192,
        capture_sizes: Sequence[int] | None = None,
    ) -> None:
        impl = getattr(model.config, "_attn_implementation", None)
        if impl != IMPLEMENTATION:
            raise ValueError(f"the model runs attn_implementation={impl!r}: call ca_hf.register() and load it with "
                             f"attn_implementation={IMPLEMENTATION!r}")
        # before anything is derived from them (a window group's block count is), naming the engine's arguments
        block_size, num_blocks, max_batch_size, max_num_batched_tokens, max_seq_len_to_capture = (
            as_int(name, value) for name, value in (
                ("block_size", block_size), ("num_blocks", num_blocks), ("max_batch_size", max_batch_size),
                ("max_num_batched_tokens", max_num_batched_tokens),
                ("max_seq_len_to_capture", max_seq_len_to_capture)))
        if cuda_graphs and names_no_sizes(capture_sizes):
            raise ValueError("capture_sizes=[] leaves the engine's CUDA graphs nothing to capture: name batch sizes, "
                             "or pass cuda_graphs=False")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.model = model.eval()
        # an id past the embedding table fails inside the step (an IndexError, a device-side
        # assert, or the compiled kernel's abort) after the request holds blocks: the scheduler refuses it
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.keep_logits = keep_logits
        modules = attention_modules(model)
        self.groups = self._make_groups([layer_settings(m) for m in modules], block_size, num_blocks,
                                        max_seq_len_to_capture, max_batch_size, max_num_batched_tokens)
        self.backend = pick_backend(backend, [g.spec for g in self.groups])
        for group in self.groups:
            s = group.settings
            for i in group.layers:
                setattr(modules[i], LAYER_ATTR, ca.Attention(
                    s.num_heads, s.head_size, s.scale, num_kv_heads=s.num_kv_heads, sliding_window=s.sliding_window,
                    logits_soft_cap=s.logits_soft_cap, backend=self.backend.get_name(),
                    group=group.name if len(self.groups) > 1 else None))
        self.kv_caches = self._allocate_caches(len(modules))
        # sliding-window groups' tables roll (paging.Scheduler frees what their window left behind)
        self.builders = {
            g.name: self.backend.get_builder_cls()(g.spec, rolling_tables=g.spec.sliding_window is not None)
            for g in self.groups
        }
        self.scheduler = Scheduler(num_blocks={g.name: g.spec.num_blocks for g in self.groups}, block_size=block_size,
                                   group_windows={g.name: g.settings.sliding_window for g in self.groups},
                                   max_num_seqs=max_batch_size, max_num_batched_tokens=max_num_batched_tokens,
                                   vocab_size=self.vocab_size)
        self._outputs: dict[int, RequestOutput] = {}
        self._step_fn, self.runner = self._make_step(compile, cuda_graphs, max_batch_size, capture_sizes)

    # -- construction ----------------------------------------------------------------------------

    def _make_groups(self, settings: list[LayerSettings], block_size: int, num_blocks: int,
                     max_seq_len_to_capture: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[LayerGroup]:
        groups: dict[LayerSettings, LayerGroup] = {}
        for i, s in enumerate(settings):
            if s not in groups:
                name = group_name(s, {g.name for g in groups.values()})
                blocks = num_blocks
                if s.sliding_window is not None:  # what its rolling tables can ever hold, + the null block
                    most = max_num_seqs * window_blocks(s.sliding_window, max_num_batched_tokens, block_size) + 1
                    blocks = min(num_blocks, most)
                spec = ca.AttentionSpec(
                    num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_size=s.head_size, block_size=block_size,
                    num_blocks=blocks, dtype=self.dtype, device=self.device, scale=s.scale,
                    sliding_window=s.sliding_window, logits_soft_cap=s.logits_soft_cap,
                    max_seq_len_to_capture=max_seq_len_to_capture)
                groups[s] = LayerGroup(name, s, [], spec)
            groups[s].layers.append(i)
        return list(groups.values())

    def _allocate_caches(self, num_layers: int) -> list[torch.Tensor]:
        caches: list[torch.Tensor | None] = [None] * num_layers
        for g in self.groups:
            spec = g.spec
            shape = self.backend.get_kv_cache_shape(spec.num_blocks, spec.block_size, spec.num_kv_heads,
                                                    spec.head_size)
            for i in g.layers:
                cache = torch.empty(shape, dtype=spec.cache_dtype, device=spec.device)
                # rolled table entries and graph pad rows read the reserved block: keep it finite
                cache[:, NULL_BLOCK].zero_()
                caches[i] = cache
        return caches

    def _make_step(self, compile: bool, cuda_graphs: bool, max_batch_size: int,
                   capture_sizes: Sequence[int] | None) -> tuple[nn.Module, CUDAGraphRunner | None]:
        cuda = self.device.type == "cuda"
        # On CUDA the runner compiles (batch 1 gets a static graph of its own, gpt-fast's way);
        # elsewhere one graph with an unbacked token count serves every step.
        runner_compiles = compile and cuda_graphs and cuda
        step: nn.Module = _ModelStep(self.model)
        postprocess = None if self.keep_logits else _greedy
        if postprocess is not None and not runner_compiles:
            step, postprocess = WithPostprocess(step, postprocess), None
        if compile and not runner_compiles:
            step = torch.compile(step, fullgraph=True, dynamic=True)
        if not cuda_graphs:
            return step, None
        if len(self.groups) == 1:
            state = self.backend.get_state_cls()(self.groups[0].spec)
        else:
            state = GroupedState({g.name: self.backend.get_state_cls()(g.spec) for g in self.groups})
        runner = CUDAGraphRunner(step, self.backend, self.groups[0].spec, self.kv_caches, state,
                                 max_batch_size=max_batch_size, capture_sizes=capture_sizes, use_cuda_graphs=cuda,
                                 progress=cuda, postprocess=postprocess, compile=runner_compiles)
        runner.capture()
        return runner.model, runner

    # -- serving ---------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 8,
                    eos_token_id: int | Sequence[int] | None = None) -> int:
        """Queue a request (it joins the running batch at the next step that has room); returns
        its id. eos_token_id None: stop only at max_new_tokens."""
        return self._add([prompt], max_new_tokens, eos_token_id)[0]

    def _add(self, prompts: Iterable[Sequence[int]], max_new_tokens: int,
             eos_token_id: int | Sequence[int] | None) -> list[int]:
        """Queue the prompts, all or none (`Scheduler.add_requests`: ValueError for a prompt id the
        model's embedding table does not hold, too), each with its output record."""
        prompts = list(prompts)  # read twice: a generator would be spent by the scheduler's checks
        ids = self.scheduler.add_requests(prompts, max_new_tokens, eos_token_id)
        for rid, prompt in zip(ids, prompts, strict=True):
            self._outputs[rid] = RequestOutput(rid, [int(t) for t in prompt], [], False, None,
                                               [] if self.keep_logits else None)
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step (decodes and prompt chunks together); returns the outputs of the requests
        that got a token in it."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        out = self._run(step)  # [num_tokens] tokens, or [num_tokens, vocab] logits
        if len(step.sample_rows) < out.shape[0]:  # prompt chunks' rows sample nothing (in decode, every row samples)
            out = out[torch.tensor(step.sample_rows, dtype=torch.int64, device=out.device)]
        logits = out.float().cpu() if self.keep_logits else None
        tokens = (out if logits is None else logits.argmax(-1)).tolist()  # the host needs the tokens: this syncs
        self.scheduler.update(step, tokens)
        return [self._record(r, token, None if logits is None else logits[i])
                for i, (r, token) in enumerate(zip(step.sampled, tokens, strict=True))]

    def output(self, request_id: int) -> RequestOutput:
        """What the request produced so far (kept after it finishes, until `pop_output`)."""
        return self._outputs[request_id]

    def pop_output(self, request_id: int) -> RequestOutput:
        """A finished request's output, forgotten by the engine (a long-running server calls
        this); ValueError for a request still running (its next step records into the output)."""
        out = self._outputs[request_id]
        if not out.finished:
            raise ValueError(f"request {request_id} is still running: pop its output once it finished "
                             "(output(request_id).finished)")
        return self._outputs.pop(request_id)

    def generate(self, prompts: Iterable[Sequence[int]], max_new_tokens: int = 8,
                 eos_token_id: int | Sequence[int] | None = None) -> list[list[int]]:
        """Greedy continuations of every prompt, served together; returns the new tokens of each.
        ValueError before anything is queued if one of them could never be served."""
        ids = self._add(prompts, max_new_tokens, eos_token_id)
        while self.has_unfinished():
            self.step()
        return [self.pop_output(i).output_tokens for i in ids]

    def blocks_in_use(self) -> dict[str, int]:
        """Per layer group, the cache blocks (per layer) its requests hold now."""
        return self.scheduler.blocks_in_use()

    def _run(self, step: ScheduledStep) -> torch.Tensor:
        mds = {g.name: self.builders[g.name].build(step.seq_lens, step.query_lens, step.block_tables[g.name])
               for g in self.groups}
        md = next(iter(mds.values())) if len(mds) == 1 else GroupedMetadata.of(mds)
        ids = torch.from_numpy(step.input_ids).to(self.device, non_blocking=True)
        pos = torch.from_numpy(step.positions).to(self.device, non_blocking=True)
        if self.runner is not None:  # its output is read to the host before the next step: no copy
            return self.runner.run(md, ids, pos, copy_output=False)
        ca.mark_token_dim(ids, pos)
        with ca.floats_as_constants(), ca.set_forward_context(md):
            return self._step_fn(ids, pos, self.kv_caches)

    def _record(self, r: ServedRequest, token: int, logits: torch.Tensor | None) -> RequestOutput:
        """`r`'s output with the token it got this step (appended: copying its tokens each step
        would cost O(length))."""
        out = self._outputs[r.request_id]
        out.output_tokens.append(token)
        if r.finish_reason is not None:
            out.finished, out.finish_reason = True, r.finish_reason
        if logits is not None:
            out.logits.append(logits)
        return out


def pick_backend(name: str | None, specs: list[ca.AttentionSpec]) -> type[ca.AttentionBackend]:
    """The named backend (or $COMPILED_ATTN_BACKEND's), checked against every group's spec, or the
    first in auto-selection order that serves every group: one forward runs one backend."""
    if name is None:  # as get_attn_backend: a falsy name given is an unknown one
        name = os.environ.get(ENV_VAR) or None
    if name is not None:
        for spec in specs:
            backend = ca.get_attn_backend(name, spec)
        return backend
    reasons = {}
    for candidate in BACKEND_CLASSES().values():
        try:
            for spec in specs:
                ca.get_attn_backend(candidate.get_name(), spec)
        except (NotImplementedError, RuntimeError) as e:
            reasons[candidate.get_name()] = str(e)
            continue
        return candidate
    raise NotImplementedError(f"no backend serves every layer group of this model: {reasons}")

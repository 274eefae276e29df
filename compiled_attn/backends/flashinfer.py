"""FLASHINFER: paged attention through FlashInfer's planned prefill / decode / ragged wrappers.

Capabilities, Metadata, Builder (host work: FlashInfer's CSR page layout, once-per-step
planning: in build() for a step holding prefills, else at its first eager use), State
(GraphState's hooks: the page buffers, one graph wrapper per batch size), Impl.

FlashInfer is imported lazily, inside the functions that plan, so this module imports (and its
builder runs, planning nothing in build(): `plans_in_build`) on machines without it: CPU tests
inspect the page layout and the fake kernel.

Planning bakes scale, window, soft-cap, ALiBi and causality into the wrappers, so they come
from the spec; a layer whose values differ raises ValueError at its first forward.

The pinned-buffer race (vLLM #32799): every FlashInfer wrapper owns one pinned host buffer that
`plan()` fills with `std::copy` and then copies to the device with an async H2D memcpy, with no
fence. Re-planning the wrapper before the GPU has executed that memcpy overwrites bytes the GPU
has not read yet. Each wrapper here carries a CUDA event recorded right after its plan; before
the next plan of that wrapper the host waits on it (`_Slot.plan`). Eager steps alternate
between two wrappers per kind, so a host that runs one step ahead of the GPU never waits. The
other half of #32799 (pinned input tensors reused across steps) cannot happen to ours: the index
tensors plan() reads on the host are fresh per step, and the device ones come from a pinned
buffer per step (`metadata.upload`) that PyTorch's caching host allocator does not hand out again
before the copy that read it has run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from compiled_attn.abstract import AttentionBackend, AttentionSpec, AttentionType
from compiled_attn.backends.common import CommonImpl
from compiled_attn.graph_state import SCRATCH_BLOCK, GraphState
from compiled_attn.metadata import (
    CommonMetadata,
    CommonMetadataBuilder,
    DeviceField,
    HostStep,
    fake_mode_active,
    prefix_sums,
)
from compiled_attn.ops.flashinfer import stream_capturing  # importing registers the op

NAME = "FLASHINFER"
# FlashInfer's recommended float workspace. It holds split-kv partial outputs (fp32): decode
# needs num_heads * (head_size + 1) * 4 bytes per partial row, at most one row per CTA of the
# grid (<= 32 CTAs/SM x 132 SMs on H100: 70 MB at 32 heads x 128); prefill ~16 KiB per query
# row at 32 x 128, so 128 MiB covers ~8K split rows. tests/test_flashinfer.py measures the
# largest captured decode plan against it (`FlashInferWrapper.workspace_size`).
WORKSPACE_BYTES = 128 << 20
# The CUDA-core decode kernel is templated on the GQA group (1,2,3,4,6,8,16). Measured on H200
# (bench/decode_flashinfer.py, 32 q / 8 kv heads, d 128, bf16): at group 4 the tensor-core kernel
# (FlashInfer's prefill kernel) is 1.05-1.7x faster at every batch and context (0.92 vs 0.59 of
# HBM bandwidth at 256 x 16384), so it serves groups >= 4; smaller groups stay on CUDA cores.
MAX_CUDA_CORE_GROUP = 3
# Split-kv spreads each (request, KV head) pair over several CTAs and merges their partial
# outputs: worth it while there are few pairs for the SMs, a cost (partials written, read back and
# merged) once there are many. Measured on an H200 (`decode_flashinfer --variants`, tensor-core
# kernel, 32 q / 8 kv heads, d 128, page 16): without split-kv 1.3-5x slower at 8 and 64 pairs
# (B=1, 8), 1-5 % faster at 512 and 2048 (B=64, 256; ctx 1024 and 4096). Pairs in between were not
# measured and keep split-kv.
NO_SPLIT_KV_MIN_PAIRS = 512
# Graphed decode through cuDNN's paged SDPA (FlashInfer's "cudnn" decode backend; needs the
# cudnn-frontend package; GRAPH_DECODE_ENV=cudnn, the default before the Triton kernel below)
# instead of FlashInfer's fastest own kernel. Measured on an H100 and an H200
# in replayed graphs (`decode_flashinfer --variants`, 32 q / 8 kv heads, d 128, bf16, page 16, the
# table as wide as the context): H100 8.2 vs 10.5 us at B=1 ctx 1024, 13.7 vs 16.3 at B=8, 96.3 vs
# 98.4 at B=64, 360 vs 365 at B=256, 11.1 vs 12.5 at B=1 ctx 4096; faster at every B in {1, 8, 64,
# 256} x ctx in {1024, 4096} on both cards but B=64 ctx 4096 (0.1-0.4 % slower). At B=1 a table 8x
# the context costs cuDNN 2 us (H200: 10.4 us, FlashInfer's 10.3); from B=8 nothing. The specs
# a kernel over block tables (cuDNN's, then Triton's below) serves (`table_decode_reason`): sm90,
# 16-bit queries over a cache of the same dtype, head size 128, no ALiBi / soft-cap (cuDNN's decode
# graph has neither) and no window: the measured case, widened to fp16, other GQA groups and page
# sizes (not timed; Triton compiles a variant for each); windows and other head sizes were not
# measured. Triton reads fp8 caches too (`triton_decode_reason`; cuDNN's graph does not): with
# fp16 products (`DecodeConfig.fp16_mma`) its kernel call is faster than FlashInfer's fp8 decode
# at all 8 points of `--triton-sweep --sweep-caches fp8` on an H200 (161.3 vs 217.6 us at B=64 ctx
# 4096, 6.6 vs 15.1 at B=1 ctx 1024; twenty-fifth session), and the 8B loop at B=64 ctx 4096, e4m3,
# ran 10.373 ms a step against the bf16 peer's 13.080 (1.261x). Eager steps stay
# on FlashInfer's wrappers: cuDNN builds a graph per shape (milliseconds), which a CUDA graph pays
# once at capture.
CUDNN_DECODE_CAPABILITY = (9, 0)
CUDNN_DECODE_HEAD_SIZES = (128,)
# Graphed decode through our own split-KV Triton kernel (ops/triton_decode.py) instead of cuDNN's,
# for the same specs (CUDNN_DECODE_CAPABILITY's comment). Measured on an H200 (`decode_flashinfer
# --triton-sweep`, replayed graphs, 32 q / 8 kv heads, d 128, bf16, page 16; Triton at the launch
# shape `default_config` picks there, against cuDNN over the same pages): us 6.7 vs 8.1 at B=1 ctx
# 1024, 11.9 vs 13.4 at B=8, 66.9 vs 71.6 at B=64, 252.9 vs 254.4 at B=256; 10.0 vs 11.0, 40.0 vs
# 41.2, 246.7 vs 252.2 and 980.2 vs 968.6 at ctx 4096. Faster at 7 of the 8 points, 1.2 % slower at
# B=256 ctx 4096. Its graphs plan nothing per step, as cuDNN's, and need no cudnn-frontend package.
# "auto" (Triton where it serves, else cuDNN, else FlashInfer's kernels), "flashinfer", "cudnn" or
# "triton" (the last two refused, naming why, where they cannot serve)
GRAPH_DECODE_ENV = "COMPILED_ATTN_FLASHINFER_GRAPH_DECODE"
# Prefill through FlashInfer's FA2 kernels on every card: FA3 lacks ALiBi and fp8 KV with 16-bit
# queries, and each FA3 variant is a separate multi-minute JIT build.
PREFILL_BACKEND = "fa2"
# Decode wrappers (eager and graphed) name FA2 rather than FlashInfer's "auto". "auto" picks FA2
# for every spec we plan (FA3's fp8 KV needs fp8 queries; ours are 16-bit), but first asks
# whether cuDNN should serve the decode, and that question imports the cudnn-frontend package at
# every eager plan(); absent, the failed import searches sys.path each time: 0.39 ms of host time a
# step (cProfile, H200 host, thirty-sixth session), more than a 16-layer decode's whole plan. On
# Blackwell with that package, "auto" could also move eager decode to cuDNN while the graphs run
# FA2: eager and graphed steps would no longer use one kernel. (cuDNN graphed decode is ours to
# pick: GRAPH_DECODE_ENV.)
DECODE_BACKEND = "fa2"
# How a step holding prefills and decodes runs: "split" (the prefill wrapper over the prefill rows,
# the decode wrapper over the decode rows: two plans, two kernels and two run() calls a layer),
# "prefill" (the prefill wrapper plans and runs every row: one of each) or "auto" (the default:
# "prefill" where decode runs on tensor cores, GQA group >= 4 (`decode_uses_tensor_cores`), whose
# kernel is FlashInfer's prefill kernel already; "split" below, where decode is the CUDA-core kernel
# and one prefill is untimed). H200, thirty-ninth session, "prefill" against "split": the 8B mixed
# step (63 decodes + a 256-token chunk) 14343 vs 14842 us with its build through the piecewise
# runner (kernels +0.7 %), 20985 vs 25199 us compiled without graphs; the 16-layer one's host time
# 2402 vs 3449 us.
MIXED_STEP_ENV = "COMPILED_ATTN_FLASHINFER_MIXED"


# ---------------------------------------------------------------------------------------------
# Capabilities


def standard_alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes, which FlashInfer derives from the head count (float32 [num_heads]).

    2^(-8 i / n) for i = 1..n with n the largest power of two <= num_heads; the remaining heads
    take the odd powers of 2^(-4 / n) (the paper's extension to other head counts).
    """
    n = 2 ** int(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * i / n) for i in range(1, 2 * (num_heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def nonstandard_alibi_reason(alibi_slopes: torch.Tensor | None, num_heads: int) -> str | None:
    """Why FlashInfer cannot apply these slopes (it only computes the standard ones), or None."""
    if alibi_slopes is None:
        return None
    want = standard_alibi_slopes(num_heads)
    if torch.allclose(alibi_slopes.detach().float().cpu(), want, rtol=1e-5, atol=0.0):
        return None
    return (
        f"{NAME} computes ALiBi slopes itself from num_heads={num_heads} (the standard "
        f"2^(-8 i / n) series); use TORCH_SDPA for other slopes"
    )


class FlashInferBackend(AttentionBackend):
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    supported_attn_types = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
    supports_alibi = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    # FlashInfer puts ALiBi inside the soft-cap's tanh (and scales it twice there); the contract
    # adds ALiBi to the capped scores
    supports_alibi_with_soft_cap = False
    requires_cuda = True
    graph_attn_types = (AttentionType.DECODER,)
    graph_supports_alibi = True
    package = "flashinfer"
    attention_op = torch.ops.compiled_attn.flashinfer_attention

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[FlashInferImpl]:
        return FlashInferImpl

    @staticmethod
    def get_metadata_cls() -> type[FlashInferMetadata]:
        return FlashInferMetadata

    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @staticmethod
    def get_state_cls() -> type[FlashInferState]:
        return FlashInferState

    @classmethod
    def supported_head_sizes(cls) -> tuple[int, ...]:
        return (64, 128, 256)

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec) -> str | None:
        return super().unsupported_reason(spec) or nonstandard_alibi_reason(spec.alibi_slopes, spec.num_heads)


# ---------------------------------------------------------------------------------------------
# Metadata


@dataclasses.dataclass
class FlashInferMetadata(CommonMetadata):
    """Common metadata plus FlashInfer's CSR page layout (int32; FlashInfer takes no other type).

    qo_indptr:              CPU int32 [num_seqs + 1], prefix sums of query_lens
    paged_kv_indptr:        CPU int32 [num_seqs + 1], prefix sums of pages per request
    paged_kv_indices:       device int32 [paged_kv_indptr[-1]], the pages of each request in order
    paged_kv_last_page_len: CPU int32 [num_seqs], tokens in each request's last page (1..block_size)
    step_plan:              the wrappers this step runs with, planned once: by build() for a step
                            holding prefills, else at the first eager use

    The indptr / last-page tensors stay on the host: `plan()` reads them there, and device
    copies would make it sync. For ENCODER_ONLY (no cache) only qo_indptr is set.
    """

    qo_indptr: torch.Tensor | None = None
    paged_kv_indptr: torch.Tensor | None = None
    paged_kv_indices: torch.Tensor | None = DeviceField(None)
    paged_kv_last_page_len: torch.Tensor | None = None
    step_plan: Any = None

    def after_upload(self) -> None:
        # still unset: every table entry is live, so the builder uploaded no page list of its
        # own (`add_backend_fields`) and the page list is the device table read row by row
        if "paged_kv_indices" not in self.__dict__:
            self.paged_kv_indices = self.block_tables.view(-1)


def paged_kv_layout(
    seq_lens: np.ndarray, block_size: int, rolled: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """FlashInfer's page CSR for requests of `seq_lens` tokens, less the pages: (indptr,
    last_page_len). The indices are each request's first ceil(seq_len / block_size) blocks less
    its first rolled[i] (rolling tables), flat in request order (what the builder checked).

    indptr int32 [n + 1]; last_page_len int32 [n] in 1..block_size. A rolled request's pages
    start at its first block in the window: FlashInfer aligns the queries with the end of the
    keys, so causality and window_left hold over the shorter key run (and it reads less).
    """
    seq = seq_lens.astype(np.int64)
    pages = -(-seq // block_size)
    last = seq - (pages - 1) * block_size
    if rolled is not None:
        pages = pages - rolled
    return prefix_sums(pages), last.astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Planning (host): wrappers, the pinned-buffer guard, one plan per step


def _flashinfer() -> Any:
    import flashinfer

    return flashinfer


def plans_in_build(spec: AttentionSpec) -> bool:
    """Whether a builder of `spec` plans its steps that hold prefills in build(): on CUDA where
    FlashInfer loads. A CPU spec's builder (page layout, CPU tests with a stand-in FlashInfer) and
    a machine without a working FlashInfer leave every step to plan at its first use, where the
    error, if any, names what is missing."""
    if spec.device.type != "cuda":
        return False
    try:
        _flashinfer()
    except Exception:  # ImportError, or OSError for a missing CUDA library: build() still builds
        return False
    return True


def _forbid_capture(what: str) -> None:
    if stream_capturing():
        raise RuntimeError(
            f"{NAME}: {what} inside CUDA-graph capture; plan outside the graph (builder metadata plans "
            "in build() when it holds prefills (on CUDA), else on first eager use; graph metadata via "
            "FlashInferState.begin_forward)"
        )


def mixed_as_prefill(spec: AttentionSpec) -> bool:
    """Whether a mixed step of `spec` runs every row through the prefill wrapper (MIXED_STEP_ENV)."""
    choice = os.environ.get(MIXED_STEP_ENV) or "auto"
    if choice not in ("auto", "split", "prefill"):
        raise ValueError(f"{MIXED_STEP_ENV}={choice!r}: use auto, split or prefill")
    return choice == "prefill" or (choice == "auto" and decode_uses_tensor_cores(spec))


def decode_uses_tensor_cores(spec: AttentionSpec) -> bool:
    """Tensor-core decode from GQA group 4 up (measured faster; the only kernel for 5, 7, > 8)."""
    return spec.num_heads // spec.num_kv_heads > MAX_CUDA_CORE_GROUP


def decode_split_options(spec: AttentionSpec, num_decodes: int) -> dict[str, Any]:
    """Plan keywords of a decode over `num_decodes` requests: split-kv off from
    NO_SPLIT_KV_MIN_PAIRS (request, KV head) pairs up (tensor-core kernel only: the one measured)."""
    if decode_uses_tensor_cores(spec) and num_decodes * spec.num_kv_heads >= NO_SPLIT_KV_MIN_PAIRS:
        return {"disable_split_kv": True}
    return {}


def table_decode_reason(spec: AttentionSpec, capability: tuple[int, int] | None, *,
                        fp8_cache: bool = False) -> str | None:
    """Why graphed decode of `spec` cannot run on a kernel over the State's lengths and block
    tables (cuDNN's or our Triton one: CUDNN_DECODE_CAPABILITY's comment), or None. `capability`:
    the card's (major, minor), None off CUDA; `fp8_cache`: fp8 caches too (Triton reads them)."""
    if capability is None:
        return "table decode kernels run on CUDA devices only"
    if tuple(capability) != CUDNN_DECODE_CAPABILITY:
        return f"table decode kernels were measured on sm90 only, this card is sm{capability[0]}{capability[1]}"
    if spec.cache_dtype != spec.dtype and not (fp8_cache and spec.cache_dtype.itemsize == 1):
        return f"this table decode kernel reads a {spec.dtype} cache, not {spec.kv_cache_dtype}"
    if spec.alibi_slopes is not None or spec.logits_soft_cap is not None:
        return "table decode kernels apply neither ALiBi nor a logits soft-cap"
    if spec.sliding_window is not None:
        return "table decode kernels with a sliding window were not measured"
    if spec.head_size not in CUDNN_DECODE_HEAD_SIZES:
        return f"table decode kernels were measured at head size {CUDNN_DECODE_HEAD_SIZES}, not {spec.head_size}"
    return None


def cudnn_decode_reason(spec: AttentionSpec, capability: tuple[int, int] | None) -> str | None:
    """Why graphed decode of `spec` cannot run on cuDNN's paged SDPA, or None."""
    reason = table_decode_reason(spec, capability)
    if reason is None and not cudnn_decode_available():
        return ("FlashInfer's cuDNN decode is unavailable: the cudnn-frontend package does not import (pip install "
                "nvidia-cudnn-frontend), or this FlashInfer has no prepare_cudnn_batch_decode")
    return reason


@functools.cache
def cudnn_decode_available() -> bool:
    """Whether FlashInfer's cuDNN decode graphs can be built here: the entry point exists and the
    cudnn-frontend package imports (a package that is found but fails to import counts as absent)."""
    try:
        from flashinfer.cudnn.decode import CUDNN_AVAILABLE, prepare_cudnn_batch_decode  # noqa: F401
    except ImportError:
        return False
    return bool(CUDNN_AVAILABLE)


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (it comes with PyTorch's CUDA builds; one found that fails to
    import counts as absent)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_decode_reason(spec: AttentionSpec, capability: tuple[int, int] | None) -> str | None:
    """Why graphed decode of `spec` cannot run on our Triton kernel (fp8 caches included), or None."""
    reason = table_decode_reason(spec, capability, fp8_cache=True)
    if reason is None and not triton_available():
        return "our Triton decode needs the triton package (pip install triton)"
    return reason


def graph_decode_kernel(spec: AttentionSpec, choice: str | None = None) -> str:
    """The kernel family of `spec`'s graphed decode: "triton", "cudnn" or "flashinfer". `choice`
    (default: the GRAPH_DECODE_ENV variable, else "auto") picks the first of Triton and cuDNN
    that can serve the spec, else FlashInfer's ("auto"); FlashInfer's always ("flashinfer");
    Triton or cuDNN always ("triton", "cudnn": NotImplementedError where they cannot serve)."""
    choice = choice or os.environ.get(GRAPH_DECODE_ENV) or "auto"
    if choice not in ("auto", "flashinfer", "cudnn", "triton"):
        raise ValueError(f"{GRAPH_DECODE_ENV}={choice!r}: use auto, flashinfer, cudnn or triton")
    if choice == "flashinfer":
        return choice
    device = torch.device(spec.device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    reasons = {  # lazily: each availability check looks for a package
        "triton": lambda: triton_decode_reason(spec, capability),
        "cudnn": lambda: cudnn_decode_reason(spec, capability),
    }
    if choice != "auto":
        reason = reasons[choice]()
        if reason is not None:
            raise NotImplementedError(f"{GRAPH_DECODE_ENV}={choice}: {reason}")
        return choice
    return next((kernel for kernel, reason in reasons.items() if reason() is None), "flashinfer")


def plan_options(spec: AttentionSpec) -> dict[str, Any]:
    """The plan() keywords every wrapper of `spec` gets (FlashInfer compiles a module per set)."""
    return dict(
        pos_encoding_mode="NONE" if spec.alibi_slopes is None else "ALIBI",
        window_left=-1 if spec.sliding_window is None else spec.sliding_window - 1,
        logits_soft_cap=spec.logits_soft_cap,
        sm_scale=spec.softmax_scale,
        q_data_type=spec.dtype,
        kv_data_type=spec.cache_dtype if spec.attn_type == AttentionType.DECODER else spec.dtype,
        o_data_type=spec.dtype,
    )


class _Slot:
    """A wrapper plus the event fencing its pinned plan buffer, and what its last plan was made for."""

    def __init__(self, wrapper: Any, device: torch.device) -> None:
        self.wrapper = wrapper
        self.fenced = device.type == "cuda"  # CPU specs (tests with a stand-in FlashInfer) have no events
        self.event: torch.cuda.Event | None = None
        # weak: a step's metadata owning its slot's plan would be cyclic garbage (StepPlan's comment)
        self._owner: weakref.ref | None = None

    def planned_for(self, owner: object) -> bool:
        """Whether the wrapper's last plan, which succeeded, was made for `owner`."""
        return self._owner is not None and self._owner() is owner

    @property
    def planned(self) -> bool:
        return self._owner is not None

    def plan(self, owner: object, plan_fn: Callable[[Any], None]) -> None:
        _forbid_capture("planning a FlashInfer wrapper")
        if self.event is not None:
            self.event.synchronize()  # the GPU has copied the previous plan out of the pinned buffer
        # FlashInfer's plan() swaps in the new page buffers before its module plans, which may
        # raise: the wrapper then holds neither plan, and the last owner must plan again
        self._owner = None
        plan_fn(self.wrapper)
        if self.fenced:
            self.event = self.event or torch.cuda.Event()
            self.event.record()
        self._owner = weakref.ref(owner)


class _WrapperPool:
    """Per builder: one float workspace and, per wrapper kind, two slots used on alternate steps."""

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        choice = mixed_as_prefill(spec)  # checked for every spec: a wrong value raises wherever it is set
        self.mixed_as_prefill = spec.attn_type == AttentionType.DECODER and choice
        self._workspace: torch.Tensor | None = None
        self._slots: dict[tuple[str, int], _Slot] = {}

    def slot(self, kind: str, turn: int) -> _Slot:
        key = (kind, turn % 2)
        if key not in self._slots:
            _forbid_capture("creating FlashInfer wrappers")
            fi = _flashinfer()
            if self._workspace is None:
                # zero-filled: FlashInfer requires it for first use
                self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.spec.device)
            if kind == "prefill":
                w = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=PREFILL_BACKEND)
            elif kind == "ragged":
                w = fi.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD", backend=PREFILL_BACKEND)
            else:
                w = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=decode_uses_tensor_cores(self.spec), backend=DECODE_BACKEND
                )
            self._slots[key] = _Slot(w, self.spec.device)
        return self._slots[key]


class _PlanChecks:
    """What every step plan checks at each op call: the layer and inputs match the spec."""

    spec: AttentionSpec
    mixed_as_prefill = False  # a mixed step's every row through the prefill wrapper (StepPlan: MIXED_STEP_ENV)

    def check_call(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor | None,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        use_alibi: bool,
        attn_type: AttentionType,
    ) -> None:
        spec = self.spec
        layer = (float(scale), sliding_window, logits_soft_cap, use_alibi)
        planned = (spec.softmax_scale, spec.sliding_window, spec.logits_soft_cap, spec.alibi_slopes is not None)
        if not math.isclose(layer[0], planned[0], rel_tol=1e-6) or layer[1:] != planned[1:]:
            raise ValueError(
                f"{NAME} plans (scale, sliding_window, logits_soft_cap, alibi) from the spec: "
                f"{planned}, but this layer has {layer}; build the spec with the layer's values"
            )
        if attn_type != spec.attn_type:
            raise ValueError(f"{NAME} metadata was planned for {spec.attn_type.name}, the layer runs {attn_type.name}")
        if query.dtype != spec.dtype:
            raise ValueError(f"query dtype {query.dtype} != spec dtype {spec.dtype}")
        if kv_cache is not None and attn_type == AttentionType.DECODER and kv_cache.dtype != spec.cache_dtype:
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} != the spec's cache dtype {spec.cache_dtype}")


class StepPlan(_PlanChecks):
    """The eager wrappers of one builder step, planned once per step, not per layer: by the
    builder for a step holding prefills, else at its first eager use.

    A wrapper re-planned for another step in between (two steps later, same slot) is re-planned
    for this one when it runs again, so old metadata stays correct. A copy of the step's metadata
    (`dataclasses.replace`) shares this plan object but plans from its own fields.
    """

    graph_safe = False

    def __init__(self, pool: _WrapperPool, turn: int) -> None:
        self.spec = pool.spec
        self.mixed_as_prefill = pool.mixed_as_prefill  # MIXED_STEP_ENV, read once per builder
        self._pool = pool
        self._turn = turn
        # The metadata is held weakly (its `step_plan` is this): a cycle would make each step's
        # metadata (~1 MB of host arrays at 256 requests x 4K tokens) garbage that only the
        # collector frees, so later builds fault in fresh pages (~30 a step).
        # (metadata, its (kind, slot) pairs): once per step, not at every layer's call
        self._slots_for: tuple[weakref.ref, tuple[tuple[str, _Slot], ...]] | None = None

    def ensure_planned(self, md: FlashInferMetadata) -> None:
        """Plan the wrappers `md`'s tokens run through, unless their last plan was `md`'s."""
        cached = self._slots_for
        if cached is None or cached[0]() is not md:
            if self.spec.attn_type == AttentionType.ENCODER_ONLY:
                kinds = ("ragged",) if md.num_tokens else ()
            else:
                decode_apart = md.num_decodes and not (md.num_prefills and self.mixed_as_prefill)
                kinds = ("prefill",) * bool(md.num_prefills) + ("decode",) * bool(decode_apart)
            cached = self._slots_for = (weakref.ref(md), tuple((k, self._pool.slot(k, self._turn)) for k in kinds))
        for kind, slot in cached[1]:
            if not slot.planned_for(md):
                slot.plan(md, functools.partial(getattr(self, f"_plan_{kind}"), md))

    def is_planned(self, md: FlashInferMetadata) -> bool:
        """Whether every wrapper `md`'s tokens run through holds `md`'s plan (its next use plans nothing)."""
        cached = self._slots_for
        return cached is not None and cached[0]() is md and all(slot.planned_for(md) for _, slot in cached[1])

    def wrapper(self, kind: str) -> Any:
        return self._pool.slot(kind, self._turn).wrapper

    def _plan_prefill(self, md: FlashInferMetadata, w: Any) -> None:
        # causal, aligned to each request's last key: a decode row (one query) sees its whole context
        spec, p = self.spec, md.num_seqs if self.mixed_as_prefill else md.num_prefills
        kv_indptr = md.paged_kv_indptr[: p + 1]
        w.plan(
            md.qo_indptr[: p + 1], kv_indptr, md.paged_kv_indices[: int(kv_indptr[-1])],
            md.paged_kv_last_page_len[:p], spec.num_heads, spec.num_kv_heads, spec.head_size,
            spec.block_size, causal=True, **plan_options(spec),
        )

    def _plan_decode(self, md: FlashInferMetadata, w: Any) -> None:
        spec, p = self.spec, md.num_prefills
        first = int(md.paged_kv_indptr[p])
        w.plan(
            md.paged_kv_indptr[p:] - first, md.paged_kv_indices[first:], md.paged_kv_last_page_len[p:],
            spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size, **plan_options(spec),
            **decode_split_options(spec, md.num_decodes),
        )

    def _plan_ragged(self, md: FlashInferMetadata, w: Any) -> None:
        spec = self.spec
        w.plan(
            md.qo_indptr, md.qo_indptr, spec.num_heads, spec.num_kv_heads, spec.head_size,
            causal=False, **plan_options(spec),
        )


# ---------------------------------------------------------------------------------------------
# Builder


class FlashInferMetadataBuilder(CommonMetadataBuilder):
    """Common metadata plus the page CSR. A step holding prefills is planned here (on CUDA where
    FlashInfer loads: `plans_in_build`; a decoder step's plan reads its page list, so its device
    fields upload here too): it never
    replays as a decode graph, and a loop that builds while the GPU runs the previous step
    overlaps the plan with it, where a plan at the first attention op held the GPU idle (the 8B
    mixed step's largest gap, thirty-seventh session). A decode-only step plans at its first
    eager use: most replay as graphs, whose State plans its own wrappers.

    Example::

        builder = FlashInferBackend.get_builder_cls()(spec)
        md = builder.build(seq_lens=[9, 33], query_lens=[9, 1], block_tables=[[3], [0, 7, 5]])
        md.paged_kv_indptr  # tensor([0, 1, 4], dtype=torch.int32)
    """

    metadata_cls = FlashInferMetadata
    backend_cls = FlashInferBackend

    def __init__(self, spec: AttentionSpec, *, rolling_tables: bool = False) -> None:
        super().__init__(spec, rolling_tables=rolling_tables)
        reason = nonstandard_alibi_reason(spec.alibi_slopes, spec.num_heads)  # beyond its capability flags
        if reason:
            raise NotImplementedError(reason)
        self._pool = _WrapperPool(spec)
        self._turn = 0
        self._plans_in_build: bool | None = None  # `plans_in_build`, asked at the first step holding prefills

    def build(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        encoder_seq_lens: list[int] | None = None,
        cross_block_tables: list[list[int]] | None = None,
    ) -> FlashInferMetadata:
        md = self.build_view(seq_lens, query_lens, block_tables, encoder_seq_lens, cross_block_tables)
        if md.num_prefills:
            if self._plans_in_build is None:
                self._plans_in_build = plans_in_build(self.spec)
            # a build under FakeTensorMode (a trace's) has fake host tensors: it plans at its first real use
            if self._plans_in_build and not fake_mode_active():
                md.step_plan.ensure_planned(md)  # a decoder's plan reads the page list: its fields upload here
        return md

    def build_view(self, *args: Any, **kwargs: Any) -> FlashInferMetadata:
        """The step unplanned (a view's build, and build()'s first half): it plans at its first use."""
        md = super().build(*args, **kwargs)
        host = md.host_arrays()
        md.qo_indptr = torch.from_numpy(host["query_start_loc"])
        if self.spec.attn_type == AttentionType.DECODER:
            indptr, last = paged_kv_layout(host["seq_lens_tensor"], self.spec.block_size, md.rolled_blocks)
            md.paged_kv_indptr = torch.from_numpy(indptr)
            if not md.has("paged_kv_indices"):  # every table entry is live: a view of the table (`after_upload`)
                md._derive_at_upload("paged_kv_indices")
            md.paged_kv_last_page_len = torch.from_numpy(last)
        md.step_plan = StepPlan(self._pool, self._turn)
        self._turn += 1
        return md

    def add_backend_fields(self, step: HostStep) -> dict[str, Any]:
        """The page list (`paged_kv_indices`: every request's pages in order), uploaded with the
        common fields. When every table entry is live (full tables: what a decode batch of one
        length has) it is the device table read row by row, so no second copy of it is made."""
        if self.spec.attn_type != AttentionType.DECODER or step.block_ids.size == step.block_table.size:
            return {}
        return {"paged_kv_indices": step.block_ids.astype(np.int32, copy=False)}  # upload packs it: no copy here


# ---------------------------------------------------------------------------------------------
# CUDA-graph state


class GraphStepPlan(_PlanChecks):
    """The one `use_cuda_graph=True` decode wrapper of a captured batch size (always planned)."""

    graph_safe = True

    def __init__(self, spec: AttentionSpec, slot: _Slot) -> None:
        self.spec = spec
        self.slot = slot

    def ensure_planned(self, md: FlashInferMetadata) -> None:
        return None  # planned at creation, then by FlashInferState.begin_forward before each replay

    def wrapper(self, kind: str) -> Any:
        return self.slot.wrapper


def _prepare_cudnn_decode() -> Callable[..., Any]:
    from flashinfer.cudnn.decode import prepare_cudnn_batch_decode

    return prepare_cudnn_batch_decode


class CudnnGraphDecode:
    """The decode wrapper of a graph that cuDNN serves (`graph_decode_kernel`): it binds the
    State's own lengths and block-table buffers, which each step's upload writes, so a replay has
    nothing to plan. cuDNN builds a graph per layout of query, caches and output (one for a model's
    layers, as a rule) at the first call that meets it: the warm-up before capture. Every graph
    built stays, with the query lengths it binds, for the CUDA graphs captured over it."""

    def __init__(self, spec: AttentionSpec, workspace: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor) -> None:
        self.spec = spec
        self._workspace = workspace
        self._bound = dict(actual_seq_lens_kv=seq_lens.view(-1, 1, 1, 1), block_tables=block_tables)
        self._query_lens = torch.ones_like(self._bound["actual_seq_lens_kv"])  # one token per decode
        self._max_kv = block_tables.shape[1] * spec.block_size
        self._prepared: dict[tuple, Any] = {}

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], *, out: torch.Tensor) -> None:
        # NHD pages as [pages, kv_heads, block_size, head_size] views: cuDNN reads any strides
        k, v = (c.transpose(-3, -2) for c in cache)
        layout = tuple((t.shape, t.stride(), t.dtype) for t in (q, k, v, out))
        prepared = self._prepared.get(layout)
        if prepared is None:
            _forbid_capture("building a cuDNN decode graph (run the graph's step once before capturing it)")
            prepared = _prepare_cudnn_decode()(
                q, k, v, self.spec.softmax_scale, max_sequence_kv=self._max_kv, out=out, return_lse=False, lse=None,
                q_len_per_req=1, window_left=-1, sinks=None, actual_seq_lens_q=self._query_lens, **self._bound)
            need = prepared.graph.get_workspace_size()
            if need > self._workspace.numel():
                raise RuntimeError(f"{NAME}: cuDNN's decode graph needs a {need}-byte workspace, more than "
                                   f"WORKSPACE_BYTES={self._workspace.numel()}; set {GRAPH_DECODE_ENV}=flashinfer")
            self._prepared[layout] = prepared
        prepared.run(q, k, v, out, None, self._workspace, **self._bound)


class TritonGraphDecode:
    """The decode wrapper of a graph that our Triton kernel serves (`graph_decode_kernel`): like
    `CudnnGraphDecode` it binds the State's lengths and block-table buffers, so a replay plans
    nothing; it owns its batch size's split buffers (`ops/triton_decode.py`)."""

    def __init__(self, spec: AttentionSpec, seq_lens: torch.Tensor, block_tables: torch.Tensor) -> None:
        from compiled_attn.ops import triton_decode  # Triton: CUDA machines only

        self.spec = spec
        self._seq_lens, self._tables = seq_lens, block_tables
        batch = seq_lens.shape[0]
        config = triton_decode.default_config(batch, spec.num_kv_heads, seq_lens.device,
                                              fp8_cache=spec.cache_dtype.itemsize == 1)
        self._decode = triton_decode.PagedDecode(batch, spec.num_heads, spec.head_size, config, seq_lens.device)

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], *, out: torch.Tensor,
            k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """k_scale / v_scale: an fp8 cache's (the op passes them for fp8 caches only)."""
        self._decode.run(q, cache[0], cache[1], self._tables, self._seq_lens, out, self.spec.softmax_scale,
                         k_scale, v_scale)


class FlashInferState(GraphState):
    """GraphState plus FlashInfer's page CSR buffers and one `use_cuda_graph=True` decode wrapper
    per captured batch size (`make_for_batch`), planned by `begin_forward` before each replay, or
    once at capture where the plan depends on the batch size alone (no split-kv on fa2: `plan`).

        paged_kv_indptr:        int32 [max_batch_size + 1]
        paged_kv_last_page_len: int32 [max_batch_size]
        paged_kv_indices:       int32 [max_batch_size * W], the live pages, then one per pad row

    written, like the common buffers, by each step's copy from the host mirror (a wrapper that
    plans copies the same CSR again); the graph of batch size bs reads the first bs * W pages at
    most. A pad row is one page of SCRATCH_BLOCK holding one token: valid for FlashInfer (every
    length >= 1). Planning waits on the wrapper's event (`_Slot.plan`): the pinned-buffer fence.

    Where `decode_kernel` is "triton" or "cudnn" (`graph_decode_kernel`), each size's wrapper is a
    `TritonGraphDecode` or `CudnnGraphDecode` over the common seq_lens_tensor / block_tables
    buffers instead: the page CSR is neither allocated nor refilled, and nothing is planned per step.
    """

    backend_cls = FlashInferBackend
    ROW_PADS = {**GraphState.ROW_PADS, "paged_kv_last_page_len": 1}

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._workspace: torch.Tensor | None = None  # shared by the graph wrappers of every size
        self.decode_kernel = graph_decode_kernel(spec)
        self.reads_tables = self.decode_kernel != "flashinfer"  # Triton and cuDNN: the common buffers
        self.decodes_on_eager_kernel = not self.reads_tables  # eager steps run FlashInfer's

    def allocate_extra(self, max_batch_size: int) -> dict[str, torch.Tensor]:
        if self.reads_tables:
            return {}  # Triton and cuDNN read the common lengths and tables, not FlashInfer's page CSR
        dev, i32 = self.spec.device, torch.int32
        # Pages of a full batch: each request holds up to max_blocks_per_seq table entries. Not
        # capped at spec.num_blocks: requests sharing prefix blocks list them once each.
        pages = max_batch_size * self.max_blocks_per_seq
        return {
            "paged_kv_indptr": torch.arange(max_batch_size + 1, dtype=i32, device=dev),
            "paged_kv_indices": torch.full((pages,), SCRATCH_BLOCK, dtype=i32, device=dev),
            "paged_kv_last_page_len": torch.ones(max_batch_size, dtype=i32, device=dev),
        }

    def make_for_batch(self, batch_size: int) -> _Slot:
        if self._workspace is None:  # zero-filled: FlashInfer requires it for first use
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.spec.device)
        b = self._buffers
        lens, tables = b["seq_lens_tensor"][:batch_size], b["block_tables"][:batch_size]
        if self.decode_kernel == "cudnn":
            return _Slot(CudnnGraphDecode(self.spec, self._workspace, lens, tables), self.spec.device)
        if self.decode_kernel == "triton":
            return _Slot(TritonGraphDecode(self.spec, lens, tables), self.spec.device)
        wrapper = _flashinfer().BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=decode_uses_tensor_cores(self.spec),
            backend=DECODE_BACKEND, paged_kv_indptr_buffer=b["paged_kv_indptr"][: batch_size + 1],
            paged_kv_indices_buffer=b["paged_kv_indices"][: batch_size * self.max_blocks_per_seq],
            paged_kv_last_page_len_buffer=b["paged_kv_last_page_len"][:batch_size],
        )
        return _Slot(wrapper, self.spec.device)

    def add_graph_fields(self, md: FlashInferMetadata, batch_size: int) -> None:
        b, n = self._buffers, batch_size
        md.qo_indptr = torch.arange(n + 1, dtype=torch.int32)
        md.step_plan = GraphStepPlan(self.spec, self._slots[n])
        if self.reads_tables:
            return
        md.paged_kv_indptr = b["paged_kv_indptr"][: n + 1]
        md.paged_kv_indices = b["paged_kv_indices"][: n * self.max_blocks_per_seq]
        md.paged_kv_last_page_len = b["paged_kv_last_page_len"][:n]

    def host_rows(self, md: FlashInferMetadata) -> dict[str, np.ndarray]:
        rows = super().host_rows(md)
        if self.reads_tables:
            return rows
        return {**rows, "paged_kv_last_page_len": self._page_layout(md)[1]}

    def _page_layout(self, md: FlashInferMetadata) -> tuple[np.ndarray, np.ndarray]:
        """md's page CSR (indptr, last_page_len): the builder's, or for metadata made otherwise
        (`dataclasses.replace`, whose lengths may differ from the fields it copied) from its lengths."""
        if md._builder is not None:
            return md.paged_kv_indptr.numpy(), md.paged_kv_last_page_len.numpy()
        return paged_kv_layout(np.asarray(md.seq_lens), self.spec.block_size, md.rolled_blocks)

    def copy_extra(self, host: dict[str, np.ndarray], md: FlashInferMetadata | None, batch_size: int) -> None:
        if self.reads_tables:
            return
        indptr, indices = host["paged_kv_indptr"], host["paged_kv_indices"]
        n = 0 if md is None else md.num_seqs
        if md is not None:
            indptr[: n + 1] = self._page_layout(md)[0]
            # the host ids of md.paged_kv_indices (`paged_kv_layout`), checked by the builder or,
            # for metadata made otherwise, by `check_graph_step` on the host table they come from
            indices[: indptr[n]] = md.needed_block_ids()
        nnz, pads = int(indptr[n]), batch_size - n
        # the pad rows' one page each
        np.add(np.arange(1, pads + 1, dtype=np.int32), nnz, out=indptr[n + 1 : batch_size + 1])
        indices[nnz : nnz + pads] = SCRATCH_BLOCK

    def plan(self, md: FlashInferMetadata | None, batch_size: int) -> None:
        if self.reads_tables:
            return  # Triton and cuDNN read the lengths and tables the step's upload wrote
        spec = self.spec
        # split-kv by the graph's size, not the live rows: capture and every replay plan one grid
        split = decode_split_options(spec, batch_size)
        slot = self._slots[batch_size]
        # FlashInfer's own attribute: the kernel family its last plan() resolved "auto" to (the
        # stand-ins of the CPU tests have none: they model fa2)
        fa2 = getattr(slot.wrapper, "_backend", "fa2") == "fa2"
        if split.get("disable_split_kv") and fa2 and slot.planned:
            # Without split-kv FlashInfer's fa2 schedule is one tile per (request, KV head): it
            # depends on the batch size alone, so the plan made at capture stands, and the page
            # CSR the kernel reads is the one the step's upload wrote: what plan() would copy,
            # without its host scheduling, its pinned copy of the same schedule and the wait on
            # that copy's fence. (FA3's plan sorts requests by length: it is re-planned every step.)
            return
        # Copies of the host mirror: plan() queues its own copies of them to the device, which
        # the next step's writes into the mirror would race (StaticInputs fences its upload only).
        host = self._inputs.host
        indptr = host["paged_kv_indptr"][: batch_size + 1].copy()
        last = host["paged_kv_last_page_len"][:batch_size].copy()
        # The static page list itself: plan() copies it onto itself, and the step's upload (or
        # the graph's, at replay, after this) writes the step's pages there.
        indices = self._buffers["paged_kv_indices"][: indptr[-1]]
        slot.plan(self, lambda w: w.plan(
            torch.from_numpy(indptr), indices, torch.from_numpy(last), spec.num_heads, spec.num_kv_heads,
            spec.head_size, spec.block_size,
            **plan_options(spec), **split,
        ))


# ---------------------------------------------------------------------------------------------
# Impl


class FlashInferImpl(CommonImpl):
    backend_cls = FlashInferBackend

    def check_supported(self) -> None:
        super().check_supported()
        reason = nonstandard_alibi_reason(self.alibi_slopes, self.num_heads)  # beyond its capability flags
        if reason:
            raise NotImplementedError(reason)

    def check_matches_metadata(self, x, kv_cache, md, attn_type) -> None:
        super().check_matches_metadata(x, kv_cache, md, attn_type)
        md.step_plan.check_call(x, kv_cache, self.scale, self.sliding_window, self.logits_soft_cap,
                                self.alibi_slopes is not None, attn_type)

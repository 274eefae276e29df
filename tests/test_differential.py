"""Differential test: random batches through every available backend against the float64 reference.

Hypothesis draws a whole configuration per example from the backend's own capabilities (dtypes,
KV-cache dtypes, attention types, head sizes, block sizes, ALiBi / window / soft-cap) plus a batch
of 1-64 requests (prefills, chunked prefills / prefix hits, 1-token prompts, decodes, mixed),
and compares each request's output with `reference.reference_forward`. Every cache comes from
`make_batch`, so slots outside a request's tokens hold NaN: a kernel that reads them fails here.

Limits (examples, lengths, work per example) come from a profile named by $HYPOTHESIS_PROFILE:
"ci" (default on CPU: 25 examples, sequences <= 512, fast enough for CI) or "device" (default for
the gpu-marked test: 200 examples per backend, sequences up to 8192).

A failing example prints a JSON line; append it to tests/regressions/differential.jsonl and it is
replayed by `test_kept_regression` on every run from then on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import Batch, make_batch, reference_forward, rel_err

import compiled_attn as ca
from compiled_attn.backends.flashinfer import MAX_CUDA_CORE_GROUP, standard_alibi_slopes
from compiled_attn.registry import BACKEND_CLASSES

T = ca.AttentionType
REGRESSIONS = Path(__file__).parent / "regressions" / "differential.jsonl"


@dataclasses.dataclass(frozen=True)
class Limits:
    """How big one profile lets an example get."""

    max_examples: int
    max_len: int  # longest sequence (seq_len / encoder_seq_len)
    max_tokens: int  # sum over requests of seq_len (+ encoder_seq_len): bounds make_batch
    max_work: float  # sum over requests of query_len * key_len * num_heads * head_size: bounds the reference
    max_block_size: int


PROFILES = {
    # ~1 s per example at worst on 2 CPU cores (the float64 reference dominates)
    "ci": Limits(max_examples=25, max_len=512, max_tokens=2000, max_work=2e7, max_block_size=64),
    # ~0.3 s per example on average: one 8192-token decode at 32 x 128 heads is 3.4e7, so long
    # decodes and chunked prefills fit; a fresh 8192-token prompt does not (its float64 reference
    # alone would take minutes)
    "device": Limits(max_examples=200, max_len=8192, max_tokens=32768, max_work=1.5e8, max_block_size=256),
}


def limits_for(default: str) -> Limits:
    name = os.environ.get("HYPOTHESIS_PROFILE", default)
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE={name!r} is not one of {sorted(PROFILES)}")
    return PROFILES[name]


# Relative error per request, against the float64 reference computed from the same (rounded)
# inputs. fp32: accumulation order only. 16-bit: output rounding (2^-8 for bf16) plus the 16-bit
# probabilities some kernels multiply V with. fp8: the reference already holds the fp8-rounded
# K/V (reference.round_trip), so what remains is the 16-bit bound, once more for the output
# rescale by v_scale, with margin for a maximum over many requests of few elements each.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
CUDA_FP32_TOL = 1e-4  # CUDA fp32 SDPA kernels reorder the sums more than CPU's
FP8_TOL = 3e-2


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn configuration and batch; JSON-serialisable so failures can be kept."""

    dtype: str
    kv_cache_dtype: str
    attn_type: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    encoder_seq_lens: tuple[int, ...] | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    alibi: bool = False
    k_scale: float = 1.0
    v_scale: float = 1.0
    seed: int = 0
    fused_qkv: bool = False  # query/key/value as column slices of one projection (row-strided views)

    @property
    def kind(self) -> T:
        return T(self.attn_type)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def spec(self, device: str) -> ca.AttentionSpec:
        return ca.AttentionSpec(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            block_size=self.block_size, num_blocks=self.num_blocks, dtype=self.torch_dtype, device=device,
            kv_cache_dtype=self.kv_cache_dtype, sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            alibi_slopes=standard_alibi_slopes(self.num_heads) if self.alibi else None, attn_type=self.kind,
        )

    def to_json(self, backend: str, device: str) -> str:
        return json.dumps({"backend": backend, "device": device, "case": dataclasses.asdict(self)})

    @classmethod
    def from_dict(cls, d: dict) -> Case:
        d = dict(d)
        for name in ("seq_lens", "query_lens", "encoder_seq_lens"):
            if d.get(name) is not None:
                d[name] = tuple(d[name])
        return cls(**d)


# -------------------------------------------------------------------------------------------
# Strategies: configurations from a backend's capabilities


# FlashInfer's feature cases (tests/test_flashinfer.py): (id, dtype, head size, cache dtype, q heads,
# kv heads, window, soft-cap, ALiBi). Kept here, not there, so that drawing a case never imports a
# test module (whose @given would then nest inside this strategy's).
FEATURE_CASES = [
    ("base", torch.bfloat16, 128, "auto", 8, 2, None, None, False),
    ("fp16_d64_mha_window", torch.float16, 64, "auto", 4, 4, 256, None, False),
    ("d256_mqa_tensorcore_softcap", torch.bfloat16, 256, "auto", 8, 1, None, 30.0, False),
    ("fp16_alibi_window", torch.float16, 128, "auto", 8, 2, 200, None, True),
    ("fp8e4m3_d64_alibi", torch.bfloat16, 64, "fp8_e4m3", 8, 8, None, None, True),
    ("fp8e5m2_fp16_tensorcore_window", torch.float16, 128, "fp8_e5m2", 16, 2, 300, None, False),
    ("fp8e4m3_d128", torch.bfloat16, 128, "fp8_e4m3", 8, 2, None, None, False),
]


def flashinfer_kernels() -> list[tuple]:
    """FlashInfer JIT-builds one module per (dtype, head size, KV dtype, window?, soft-cap?, ALiBi?)
    and per decode kernel kind (CUDA cores up to group 4, tensor cores above): the differential
    test draws only the variants tests/test_flashinfer.py's cases build (and its prewarm compiles),
    so 200 examples cost no extra multi-minute compiles. Everything else is drawn freely."""
    return sorted({
        (dtype, d, kv, window is not None, cap is not None, alibi, hq // hkv > MAX_CUDA_CORE_GROUP)
        for _, dtype, d, kv, hq, hkv, window, cap, alibi in FEATURE_CASES
    }, key=str)


ANY_HEAD_SIZES = {"cpu": (8, 16, 32, 64, 80, 128), "cuda": (32, 64, 80, 96, 128, 256)}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SOFT_CAPS = (0.5, 2.0, 10.0, 30.0)
FP8_SCALES = (0.25, 0.5, 1.0, 2.0)


@st.composite
def cases(draw, backend: type[ca.AttentionBackend], device: str, limits: Limits) -> Case:
    """A configuration `backend` supports and a batch within `limits`."""
    name = backend.get_name()
    types = list(backend.supported_attn_types)
    # decoder attention is what serving runs: draw it three times in four
    kind = T.DECODER if draw(st.integers(0, 3)) else draw(st.sampled_from(types))
    window_ok = backend.supports_sliding_window and kind == T.DECODER
    cap_ok = backend.supports_logits_soft_cap
    alibi_ok = backend.supports_alibi and kind != T.ENCODER_DECODER
    group_side = None
    if name == "FLASHINFER":
        variants = [v for v in flashinfer_kernels()
                    if kind == T.DECODER or (v[2] == "auto" and not v[3])]  # ENCODER_ONLY: no cache, no window
        dtype, head_size, kv_cache_dtype, window_ok, cap_ok, alibi_ok, group_side = draw(st.sampled_from(variants))
    else:
        dtype = draw(st.sampled_from(backend.supported_dtypes))
        head_size = draw(st.sampled_from(backend.supported_head_sizes() or ANY_HEAD_SIZES[device]))
        cache_kinds = backend.supported_kv_cache_dtypes if kind in (T.DECODER, T.ENCODER_DECODER) else ("auto",)
        kv_cache_dtype = draw(st.sampled_from(cache_kinds))
    num_kv_heads = draw(st.integers(1, 4))
    groups = (1, 2, 3, 4, 8)
    if group_side is not None:
        groups = tuple(g for g in (1, 2, 3, 4, 6, 8) if (g > MAX_CUDA_CORE_GROUP) == group_side)
    group = draw(st.sampled_from(groups))
    num_heads = num_kv_heads * group
    block_size = draw(st.sampled_from([b for b in BLOCK_SIZES
                                       if b <= limits.max_block_size and backend.supports_block_size(b)]))
    fixed = name == "FLASHINFER"  # the variant decides whether the feature is on
    sliding_window = None
    if window_ok and (fixed or draw(st.booleans())):
        sliding_window = draw(st.integers(1, limits.max_len))
    logits_soft_cap = draw(st.sampled_from(SOFT_CAPS)) if cap_ok and (fixed or draw(st.booleans())) else None
    alibi = bool(alibi_ok and (fixed or draw(st.booleans())))
    fp8 = kv_cache_dtype != "auto"
    k_scale = draw(st.sampled_from(FP8_SCALES)) if fp8 else 1.0
    v_scale = draw(st.sampled_from(FP8_SCALES)) if fp8 else 1.0

    seq_lens, query_lens, encoder_seq_lens = draw(batch_lengths(kind, num_heads * head_size, limits))
    need = sum(-(-s // block_size) for s in seq_lens) + sum(-(-e // block_size) for e in encoder_seq_lens or ())
    num_blocks = need + draw(st.integers(0, 8))  # spare blocks: absent from every table, NaN-filled
    return Case(
        dtype=str(dtype).removeprefix("torch."), kv_cache_dtype=kv_cache_dtype, attn_type=kind.value,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
        num_blocks=num_blocks, seq_lens=seq_lens, query_lens=query_lens, encoder_seq_lens=encoder_seq_lens,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi=alibi, k_scale=k_scale,
        v_scale=v_scale, seed=draw(st.integers(0, 2**16)), fused_qkv=draw(st.booleans()),
    )


@st.composite
def batch_lengths(draw, kind: T, width: int, limits: Limits):
    """(seq_lens, query_lens, encoder_seq_lens) of 1-64 requests, prefills first.

    Each request gets an equal share of the token and work budgets, so a batch is either wide
    (many short requests) or long (few long ones); a prefill's query is what its share of work
    allows (a fresh prompt when its whole length fits, a chunk over cached context otherwise).
    """
    n = draw(st.integers(1, 64))
    tokens = max(2, limits.max_tokens // n)
    work = max(1, int(limits.max_work // (n * width)))  # query_len * key_len per request
    longest = min(limits.max_len, tokens)
    if kind in (T.ENCODER_ONLY, T.ENCODER):
        side = max(1, min(longest, math.isqrt(work)))
        lens = tuple(draw(st.lists(st.integers(1, side), min_size=n, max_size=n)))
        if kind == T.ENCODER_ONLY:
            return lens, lens, None
        dec = tuple(draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)))
        return dec, dec, lens
    enc = None
    if kind == T.ENCODER_DECODER:
        enc = tuple(draw(st.lists(st.integers(1, max(1, longest // 2)), min_size=n, max_size=n)))
        longest = max(2, longest // 2)
    num_prefills = draw(st.integers(0, n))
    seq_lens, query_lens = [], []
    for i in range(n):
        if i >= num_prefills:  # decode
            cap = max(2, min(longest, work if enc is None else longest))
            seq_lens.append(draw(st.integers(2, cap)))
            query_lens.append(1)
            continue
        s = draw(st.integers(1, longest))
        q_cap = max(1, min(s, work // (s if enc is None else enc[i])))
        q = draw(st.one_of(st.just(q_cap), st.integers(1, q_cap)))
        if q == 1 and s > 1:  # query_len 1 with context is a decode: make it a 2-token chunk or a 1-token prompt
            s, q = (s, 2) if q_cap >= 2 else (1, 1)
        seq_lens.append(s)
        query_lens.append(q)
    return tuple(seq_lens), tuple(query_lens), enc


# -------------------------------------------------------------------------------------------
# Running one case


MaybeTensor = torch.Tensor | None


def fused(query: torch.Tensor, key: MaybeTensor, value: MaybeTensor) -> tuple[torch.Tensor, MaybeTensor, MaybeTensor]:
    """Equal copies of query / key / value as column slices of wider tensors (rows strided by the
    fused width): all three of one QKV projection where their rows agree, else (cross attention's
    encoder K/V, or no K/V) the query beside a spare block of columns and key with value."""
    def slices(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.cat(xs, dim=1).split([x.shape[1] for x in xs], dim=1)

    if key is not None and key.shape[0] == query.shape[0]:
        out = slices(query, key, value)
    else:
        out = (slices(query, query)[0], *(slices(key, value) if key is not None else (None, None)))
    assert all(x.stride(0) > x.shape[1] for x in out if x is not None)  # every one a slice
    return out


def inputs(case: Case, batch: Batch) -> tuple[torch.Tensor, MaybeTensor, MaybeTensor, MaybeTensor]:
    """(query, key, value, kv_cache) of the forward for the case's attention type; with
    `case.fused_qkv` the query and the key / value of the same rows are slices of one tensor."""
    *qkv, kv_cache = unfused_inputs(case, batch)
    return (*(fused(*qkv) if case.fused_qkv else qkv), kv_cache)


def unfused_inputs(case: Case, batch: Batch) -> tuple[torch.Tensor, MaybeTensor, MaybeTensor, MaybeTensor]:
    device = batch.query.device
    kind = case.kind
    if kind == T.ENCODER:
        key = torch.cat(batch.enc_k).flatten(1).to(device)
        value = torch.cat(batch.enc_v).flatten(1).to(device)
        return batch.encoder_query(), key, value, None
    if kind == T.ENCODER_ONLY:
        return batch.query, batch.key, batch.value, None
    if kind == T.ENCODER_DECODER:
        has_prefill = any(not (q == 1 and s > 1) for s, q in zip(case.seq_lens, case.query_lens, strict=True))
        if not has_prefill:  # a later step: every encoder K/V is cached already
            return batch.query, None, None, batch.kv_cache
        key, value = (x.to(device) for x in batch.encoder_kv())
        return batch.query, key, value, batch.kv_cache
    return batch.query, batch.key, batch.value, batch.kv_cache


def impl_for(case: Case, backend: type[ca.AttentionBackend], spec: ca.AttentionSpec) -> ca.AttentionImpl:
    return backend.get_impl_cls()(
        case.num_heads, case.head_size, spec.softmax_scale, num_kv_heads=case.num_kv_heads,
        alibi_slopes=spec.alibi_slopes, sliding_window=case.sliding_window, kv_cache_dtype=case.kv_cache_dtype,
        logits_soft_cap=case.logits_soft_cap,
    )


@dataclasses.dataclass
class Prepared:
    """A case ready to run: its batch (NaN outside the context), metadata, impl and forward inputs."""

    case: Case
    batch: Batch
    metadata: ca.AttentionMetadata
    impl: ca.AttentionImpl
    query: torch.Tensor
    key: MaybeTensor
    value: MaybeTensor
    kv_cache: MaybeTensor

    def forward(self, kv_cache: MaybeTensor = None) -> torch.Tensor:
        """The eager forward, on `kv_cache` instead of the batch's cache when given."""
        c = self.case
        cache = self.kv_cache if kv_cache is None else kv_cache
        return self.impl.forward(self.query, self.key, self.value, cache, self.metadata, k_scale=c.k_scale,
                                 v_scale=c.v_scale, attn_type=c.kind)


def prepare(case: Case, backend: type[ca.AttentionBackend], device: str) -> Prepared:
    spec = case.spec(device)
    batch = make_batch(spec, list(case.seq_lens), list(case.query_lens), seed=case.seed,
                       encoder_seq_lens=None if case.encoder_seq_lens is None else list(case.encoder_seq_lens),
                       k_scale=case.k_scale, v_scale=case.v_scale)
    return Prepared(case, batch, batch.build(backend), impl_for(case, backend, spec), *inputs(case, batch))


def request_rows(case: Case) -> list[int]:
    return list(case.encoder_seq_lens if case.kind == T.ENCODER else case.query_lens)


def tolerance(case: Case, device: str) -> float:
    if case.kv_cache_dtype != "auto":
        return FP8_TOL
    if case.torch_dtype == torch.float32 and device == "cuda":
        return CUDA_FP32_TOL
    return TOLERANCE[case.torch_dtype]


def check_against_reference(case: Case, backend: type[ca.AttentionBackend], device: str) -> None:
    """Every request's output within tolerance of the float64 reference (finite: NaN gives inf)."""
    prep = prepare(case, backend, device)
    output = prep.forward()
    ref = reference_forward(prep.batch, case.kind, sliding_window=case.sliding_window,
                            logits_soft_cap=case.logits_soft_cap, alibi=prep.batch.spec.alibi_slopes,
                            k_scale=case.k_scale, v_scale=case.v_scale)
    out = output.cpu()
    assert out.shape == ref.shape and output.dtype == case.torch_dtype
    tol = tolerance(case, device)
    errs = [rel_err(o, r) for o, r in zip(out.split(request_rows(case)), ref.split(request_rows(case)), strict=True)]
    worst = max(range(len(errs)), key=errs.__getitem__)
    assert errs[worst] <= tol, (
        f"request {worst} of {len(errs)}: rel err {errs[worst]:.3e} > {tol:.0e}; keep this example in "
        f"{REGRESSIONS.relative_to(Path(__file__).parent.parent)}:\n{case.to_json(backend.get_name(), device)}"
    )


def available(name: str, device: str) -> type[ca.AttentionBackend]:
    """The backend class, or skip: not shipped, unavailable here, or no such device."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cls = BACKEND_CLASSES().get(name)
    if cls is None:
        pytest.skip(f"{name} is not part of this build")
    reason = cls.unavailable_reason()
    if reason is not None:
        pytest.skip(f"{name} unavailable: {reason}")
    if cls.requires_cuda and device != "cuda":
        pytest.skip(f"{name} runs on CUDA only")
    return cls


def check_drawn_cases(check: Callable[[Case, type[ca.AttentionBackend], str], None],
                      backend: type[ca.AttentionBackend], device: str, limits: Limits) -> None:
    """`check(case, backend, device)` on Hypothesis-drawn cases of `backend` within `limits`."""

    @differential_settings(limits)
    @given(case=cases(backend, device, limits))
    def run(case):
        check(case, backend, device)

    run()


def differential_settings(limits: Limits) -> settings:
    # deadline=None: one example builds a cache and a float64 reference, seconds on a slow runner;
    # too_slow/data_too_large: batches are large on purpose.
    return settings(max_examples=limits.max_examples, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -------------------------------------------------------------------------------------------
# Tests

CI_LIMITS = limits_for("ci")
DEVICE_LIMITS = limits_for("device")
SDPA = BACKEND_CLASSES()["TORCH_SDPA"]


def test_cpu_backend_matches_reference(cpu_backend):
    check_drawn_cases(check_against_reference, cpu_backend, "cpu", CI_LIMITS)


@pytest.mark.gpu
@pytest.mark.long(50)
@pytest.mark.parametrize("name", list(BACKEND_CLASSES()))
def test_backend_cuda_matches_reference(name):
    check_drawn_cases(check_against_reference, available(name, "cuda"), "cuda", DEVICE_LIMITS)


def kept_regressions() -> list:
    if not REGRESSIONS.exists():
        return []
    lines = [line for line in REGRESSIONS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    entries = [json.loads(line) for line in lines]
    # CUDA entries carry the gpu mark, so the device run (`pytest -m gpu`) replays them
    return [pytest.param(e, id=f"{i}-{e['backend']}", marks=[pytest.mark.gpu] if e["device"] == "cuda" else [])
            for i, e in enumerate(entries)]


@pytest.mark.parametrize("entry", kept_regressions()
                         or [pytest.param(None, marks=pytest.mark.skip(reason="no kept failing examples"))])
def test_kept_regression(entry):
    device = entry["device"]
    backend = available(entry["backend"], device)
    check_against_reference(Case.from_dict(entry["case"]), backend, device)


def test_every_kept_regression_is_a_valid_case():
    # a malformed line would otherwise only show up as a confusing failure on the device
    for param in kept_regressions():
        entry = param.values[0]
        assert entry["backend"] in BACKEND_CLASSES() and entry["device"] in ("cpu", "cuda")
        Case.from_dict(entry["case"]).spec("cpu")


@settings(max_examples=10, deadline=None)
@given(case=cases(SDPA, "cpu", CI_LIMITS))
def test_cases_survive_the_regression_file_format(case):
    entry = json.loads(case.to_json("TORCH_SDPA", "cpu"))
    assert Case.from_dict(entry["case"]) == case

"""Mutation fuzzer over every public entry point: a valid step, one mutation, then the contract.

Each example draws a valid step (spec, layer, a batch mix of prefills, chunks and decodes, block
tables, a cache whose unused slots hold NaN), applies ONE mutation from `CATALOGUE` to one
argument of one entry point (type, dtype, device, shape, range, duplicates, ordering, options
mismatch), runs the whole path (AttentionSpec, builder, impl or ca.Attention, forward) and
asserts one of:

- an error of the type the mutation documents (ValueError for invalid input, NotImplementedError
  for what a backend lacks, RuntimeError for lifecycle misuse), with every cache (and static
  graph buffer) bit for bit unchanged, no forward context left set and no layer registration
  left behind;
- success, with each request's output equal to the float64 reference (`reference.py`, for the
  layer's effective options) and the cache changed exactly at this step's slots.

Each mutation says which it allows: invalid input must raise; a semantics-preserving one (numpy
ints, table entries past a request's need, strided tensors, a cache listed twice) must succeed;
an options mismatch may do either (TORCH_SDPA takes each layer's own options, FLASHINFER and
XFORMERS refuse what differs from the spec they planned with).

Paths: TORCH_SDPA through impl.forward and ca.Attention; FLASHINFER and XFORMERS through
impl.forward with the dense float64 stand-ins of tests/test_flashinfer.py / tests/test_xformers.py
(all host logic and checks, no kernels); a graph State's refill; copy_blocks / swap_blocks; and a
compiled ca.Attention. CPU in CI; the gpu-marked test runs every backend's real kernels.

Every catalogue entry is its own test, so each runs on every run. FUZZ_EXAMPLES=N sets the examples
per entry (CPU defaults add up to > 2,000; the gpu-marked ones to >= 300 per backend).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import unittest.mock
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from reference import Batch, make_batch, reference_forward, rel_err, stored
from test_differential import (
    FP8_SCALES,
    SOFT_CAPS,
    Case,
    available,
    flashinfer_kernels,
    inputs,
    request_rows,
    tolerance,
)
from test_flashinfer import DENSE_FLASHINFER
from test_forward_context import no_context
from test_xformers import dense_float64_kernel

import compiled_attn as ca
from compiled_attn import forward_context
from compiled_attn.backends import flashinfer as fib
from compiled_attn.backends.flashinfer import MAX_CUDA_CORE_GROUP, standard_alibi_slopes
from compiled_attn.ops import xformers as xformers_ops
from compiled_attn.registry import BACKEND_CLASSES
from compiled_attn.validation import CACHE_WRITING_TYPES, CACHELESS_TYPES

T = ca.AttentionType
V, VN, VR = (ValueError,), (ValueError, NotImplementedError), (ValueError, RuntimeError)
SDPA = BACKEND_CLASSES()["TORCH_SDPA"]
GPU_EXAMPLES = 300


def examples(default: int) -> int:
    return int(os.environ.get("FUZZ_EXAMPLES", default))


def fuzz_settings(n: int) -> settings:
    # deadline=None: a first example imports and warms up; the database would replay old failures
    # of a changed catalogue, so examples are drawn afresh each run
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# -------------------------------------------------------------------------------------------
# Valid steps


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a mutation needs of the drawn step (so that every mutation applies to every example)."""

    kinds: tuple[T, ...] | None = None  # attention types the step may have
    fresh: bool = False  # prefills only, each a fresh prompt (seq_len == query_len)
    mixed: bool = False  # at least one prefill and one decode
    has_prefill: bool = False
    min_requests: int = 1
    long_table: bool = False  # request 0 needs >= 2 blocks


ANY = Needs()


@st.composite
def tiny_cases(draw, backend: type[ca.AttentionBackend], device: str, needs: Needs = ANY) -> Case:
    """A configuration `backend` supports and a batch of 1-4 requests of <= 12 tokens (request 0
    longer when `needs.long_table`)."""
    name = backend.get_name()
    kinds = [k for k in backend.supported_attn_types if needs.kinds is None or k in needs.kinds]
    if needs.fresh or needs.mixed:
        kinds = [k for k in kinds if k in (T.DECODER, T.ENCODER_DECODER)]
    kind = T.DECODER if T.DECODER in kinds and draw(st.integers(0, 2)) else draw(st.sampled_from(kinds))
    if name == "FLASHINFER":  # only the kernel variants tests/test_flashinfer.py builds (GPU: no JIT)
        variants = [v for v in flashinfer_kernels() if kind == T.DECODER or (v[2] == "auto" and not v[3])]
        dtype, head_size, kv_cache_dtype, window_on, cap_on, alibi_on, tensor_cores = draw(st.sampled_from(variants))
        groups = [g for g in (1, 2, 4, 8) if (g > MAX_CUDA_CORE_GROUP) == tensor_cores]
        block_sizes = (4, 16)
    else:
        if device == "cpu" and name == "XFORMERS":
            dtype = torch.float32  # the float64 stand-in kernel, as test_xformers runs it
        else:
            dtype = draw(st.sampled_from(backend.supported_dtypes))
        head_size = draw(st.sampled_from((8, 16) if name == "TORCH_SDPA" else (64,)))
        kv_cache_dtype = "auto"
        window_on = backend.supports_sliding_window and kind == T.DECODER and draw(st.booleans())
        cap_on = backend.supports_logits_soft_cap and draw(st.booleans())
        alibi_on = backend.supports_alibi and kind != T.ENCODER_DECODER and draw(st.booleans())
        groups = (1, 2, 4)
        block_sizes = (1, 2, 4, 8) if name == "TORCH_SDPA" else (64,)
    num_kv_heads = draw(st.integers(1, 2))
    block_size = draw(st.sampled_from(block_sizes))
    fp8 = kv_cache_dtype != "auto"
    n = draw(st.integers(max(needs.min_requests, 2 if needs.mixed else 1), 4))
    encoder_seq_lens = None
    if kind in (T.ENCODER_ONLY, T.ENCODER):
        seq_lens = query_lens = [draw(st.integers(1, 8)) for _ in range(n)]
        if kind == T.ENCODER:
            seq_lens = query_lens = [draw(st.integers(1, 3)) for _ in range(n)]
            encoder_seq_lens = [draw(st.integers(1, 8)) for _ in range(n)]
    else:
        if needs.fresh:
            num_prefills = n
        elif needs.mixed:
            num_prefills = draw(st.integers(1, n - 1))
        else:
            num_prefills = draw(st.integers(1 if needs.has_prefill else 0, n))
        seq_lens, query_lens = [], []
        for i in range(n):
            longest = 2 * block_size + 3 if i == 0 and needs.long_table else 12
            if i < num_prefills:
                s = draw(st.integers(2 * block_size + 1 if i == 0 and needs.long_table else 1, longest))
                q = s if needs.fresh else draw(st.integers(1, min(s, 12)))
                s, q = (s, q) if not (q == 1 and s > 1) else (s, 2)
            else:
                s, q = draw(st.integers(2 * block_size + 1 if i == 0 and needs.long_table else 2, longest)), 1
            seq_lens.append(s)
            query_lens.append(q)
        if kind == T.ENCODER_DECODER:
            encoder_seq_lens = [draw(st.integers(1, 6)) for _ in range(n)]
    need = sum(-(-s // block_size) for s in seq_lens) + sum(-(-e // block_size) for e in encoder_seq_lens or ())
    return Case(
        dtype=str(dtype).removeprefix("torch."), kv_cache_dtype=kv_cache_dtype, attn_type=kind.value,
        num_heads=num_kv_heads * draw(st.sampled_from(groups)), num_kv_heads=num_kv_heads, head_size=head_size,
        block_size=block_size, num_blocks=need + draw(st.integers(0, 3)), seq_lens=tuple(seq_lens),
        query_lens=tuple(query_lens), encoder_seq_lens=None if encoder_seq_lens is None else tuple(encoder_seq_lens),
        sliding_window=draw(st.integers(1, 12)) if window_on else None,
        logits_soft_cap=draw(st.sampled_from(SOFT_CAPS)) if cap_on else None, alibi=bool(alibi_on),
        k_scale=draw(st.sampled_from(FP8_SCALES)) if fp8 else 1.0,
        v_scale=draw(st.sampled_from(FP8_SCALES)) if fp8 else 1.0, seed=draw(st.integers(0, 2**16)),
    )


@dataclasses.dataclass
class Scenario:
    """Every argument of every entry point of one step, as the mutations edit them."""

    case: Case
    backend: type[ca.AttentionBackend]
    device: str
    batch: Batch
    name: object  # what get_attn_backend / ca.Attention(backend=) get
    spec_kw: dict  # AttentionSpec(**spec_kw)
    layer_kw: dict  # impl / ca.Attention constructor
    build_kw: dict  # builder.build(**build_kw)
    fwd: dict  # query, key, value, kv_cache, k_scale, v_scale, attn_type
    metadata: Callable | None = None  # (md, spec, backend) -> what the forward gets instead of md
    in_context: bool = True  # ca.Attention: called inside set_forward_context

    @property
    def kind(self) -> T:
        return self.case.kind

    @property
    def writes(self) -> bool:
        return self.kind in CACHE_WRITING_TYPES and self.fwd["key"] is not None

    @property
    def batch_has_prefill(self) -> bool:
        return any(not (q == 1 and s > 1) for s, q in zip(self.case.seq_lens, self.case.query_lens, strict=True))


def scenario(case: Case, backend: type[ca.AttentionBackend], device: str) -> Scenario:
    spec = case.spec(device)
    enc = None if case.encoder_seq_lens is None else list(case.encoder_seq_lens)
    batch = make_batch(spec, list(case.seq_lens), list(case.query_lens), seed=case.seed, encoder_seq_lens=enc,
                       k_scale=case.k_scale, v_scale=case.v_scale)
    query, key, value, kv_cache = inputs(case, batch)
    return Scenario(
        case=case, backend=backend, device=device, batch=batch, name=backend.get_name(),
        spec_kw={f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)},
        layer_kw=dict(num_heads=case.num_heads, head_size=case.head_size, scale=spec.softmax_scale,
                      num_kv_heads=case.num_kv_heads, alibi_slopes=spec.alibi_slopes,
                      sliding_window=case.sliding_window, kv_cache_dtype=case.kv_cache_dtype,
                      logits_soft_cap=case.logits_soft_cap),
        build_kw=dict(seq_lens=list(case.seq_lens), query_lens=list(case.query_lens),
                      block_tables=[list(t) for t in batch.block_tables], encoder_seq_lens=enc,
                      cross_block_tables=None if case.kind != T.ENCODER_DECODER  # ENCODER reads no cache
                      else [list(t) for t in batch.cross_block_tables]),
        fwd=dict(query=query, key=key, value=value, kv_cache=kv_cache, k_scale=case.k_scale, v_scale=case.v_scale,
                 attn_type=case.kind),
    )


# -------------------------------------------------------------------------------------------
# The catalogue


@dataclasses.dataclass(frozen=True)
class Expect:
    errors: tuple[type[BaseException], ...] = V  # error types allowed (empty: must succeed)
    may_succeed: bool = False  # success allowed (then it must equal the reference)


OK = Expect(errors=(), may_succeed=True)
EITHER = Expect(errors=VN, may_succeed=True)
Mutate = Callable[[Callable, Scenario], Expect | None]  # (draw, scenario) -> expectation; None: n/a
CATALOGUE: dict[str, Mutate] = {}
NEEDS: dict[str, Needs] = {}


def mutation(name: str, needs: Needs = ANY) -> Callable[[Mutate], Mutate]:
    def register(fn: Mutate) -> Mutate:
        CATALOGUE[name] = fn
        NEEDS[name] = needs
        return fn

    return register


def bad_int(draw, valid: int, none_valid: bool = False) -> object:
    """Something that is not a valid count: 0, negative, a float (even integral), a string, None
    (unless that is valid), a float tensor, a bool, past int32 or int64, a list."""
    return draw(st.sampled_from([0, -1, float(valid), str(valid), torch.tensor(float(valid)), True, 2**31, 2**63,
                                 [valid]] + ([] if none_valid else [None])))


def same_int(draw, valid: int) -> object:
    return draw(st.sampled_from([np.int64(valid), np.int32(valid), torch.tensor(valid)]))


def bad_real(draw) -> object:
    return draw(st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf, "1.0", True, None, [1.0]]))


SPEC_INTS = ("num_heads", "num_kv_heads", "head_size", "block_size", "num_blocks", "max_seq_len_to_capture")
LAYER_INTS = ("num_heads", "head_size", "num_kv_heads")

for _field in SPEC_INTS:
    mutation(f"spec.{_field}.bad")(lambda draw, sc, f=_field: sc.spec_kw.__setitem__(f, bad_int(draw, sc.spec_kw[f]))
                                   or Expect())
    mutation(f"spec.{_field}.numpy_or_tensor")(
        lambda draw, sc, f=_field: sc.spec_kw.__setitem__(f, same_int(draw, sc.spec_kw[f])) or OK)
for _field in LAYER_INTS:
    mutation(f"layer.{_field}.bad")(  # num_kv_heads=None means num_heads
        lambda draw, sc, f=_field: sc.layer_kw.__setitem__(f, bad_int(draw, sc.layer_kw[f], f == "num_kv_heads"))
        or Expect())
    mutation(f"layer.{_field}.numpy_or_tensor")(
        lambda draw, sc, f=_field: sc.layer_kw.__setitem__(f, same_int(draw, sc.layer_kw[f])) or OK)


@mutation("layer.heads.other")
def _(draw, sc):
    field = draw(st.sampled_from(LAYER_INTS))
    sc.layer_kw[field] *= 2  # still a valid layer (heads divide), unlike the tensors and the spec
    return Expect(errors=VN)


@mutation("spec.dtype.bad")
def _(draw, sc):
    sc.spec_kw["dtype"] = draw(st.sampled_from(["float32", None, torch.int32, torch.bool, 3]))
    return Expect()


@mutation("spec.dtype.other_float")
def _(draw, sc):
    sc.spec_kw["dtype"] = draw(st.sampled_from([d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
                                                if d != sc.spec_kw["dtype"]]))
    return EITHER  # TORCH_SDPA and XFORMERS compute in the query's dtype; FLASHINFER planned the spec's


@mutation("spec.device.bad")
def _(draw, sc):
    sc.spec_kw["device"] = draw(st.sampled_from(["cdua", None, 3.5, [0], "cuda:99"]))
    return Expect()


@mutation("spec.device.other")
def _(draw, sc):
    choices = ["meta"] + (["cpu"] if sc.device == "cuda" else []) + ([] if torch.cuda.is_available() else ["cuda"])
    sc.spec_kw["device"] = draw(st.sampled_from(choices))  # "cuda" without CUDA: refused at the builder
    return Expect()


@mutation("spec.kv_cache_dtype.bad")
def _(draw, sc):
    sc.spec_kw["kv_cache_dtype"] = draw(st.sampled_from([None, "int4", ["auto"], torch.float8_e4m3fn, "FP8"]))
    return Expect()


@mutation("spec.kv_cache_dtype.other")
def _(draw, sc):
    sc.spec_kw["kv_cache_dtype"] = "fp8_e5m2" if sc.spec_kw["kv_cache_dtype"] == "auto" else "auto"
    return Expect(errors=VN, may_succeed=sc.kind in CACHELESS_TYPES)  # a cacheless layer has no cache dtype


for _field in ("scale", "logits_soft_cap"):
    mutation(f"spec.{_field}.bad")(lambda draw, sc, f=_field: sc.spec_kw.__setitem__(f, draw(st.sampled_from(
        [0.0, -1.0, math.nan, math.inf, -math.inf, "30", True, [1.0]]))) or Expect())  # None: the default
    mutation(f"layer.{_field}.bad")(lambda draw, sc, f=_field: sc.layer_kw.__setitem__(f, bad_real(draw) if f == "scale"
                                    else draw(st.sampled_from([0.0, -1.0, math.nan, math.inf, "30", True, [1.0]])))
                                    or Expect())


@mutation("spec.sliding_window.bad")
def _(draw, sc):
    sc.spec_kw["sliding_window"] = draw(st.sampled_from([0, -3, 2.5, "4", 2**40, math.nan, True]))
    return Expect()


@mutation("layer.sliding_window.bad")
def _(draw, sc):
    sc.layer_kw["sliding_window"] = draw(st.sampled_from([0, -3, 2.5, "4", 2**40, math.nan, True]))
    return Expect()


def other_option(draw, kw: dict, field: str, num_heads: int) -> None:
    """A different valid value of a layer option (on where it was off, off where it was on)."""
    on = kw[field] is not None
    if field == "scale":
        kw[field] = (kw[field] or kw["head_size"] ** -0.5) * 0.5
    elif field == "sliding_window":
        kw[field] = None if on else draw(st.integers(1, 12))
    elif field == "logits_soft_cap":
        kw[field] = None if on else draw(st.sampled_from(SOFT_CAPS))
    else:
        kw[field] = None if on else standard_alibi_slopes(num_heads)


OPTIONS = ("scale", "sliding_window", "logits_soft_cap", "alibi_slopes")


@mutation("spec.options.other")
def _(draw, sc):
    other_option(draw, sc.spec_kw, draw(st.sampled_from(OPTIONS)), sc.case.num_heads)
    return EITHER  # the layer is unchanged: correct where the backend takes the layer's options


@mutation("layer.options.other")
def _(draw, sc):
    other_option(draw, sc.layer_kw, draw(st.sampled_from(OPTIONS)), sc.case.num_heads)
    return EITHER  # success must equal the reference of the layer's options


@mutation("spec.alibi_slopes.bad")
def _(draw, sc):
    sc.spec_kw["alibi_slopes"] = bad_slopes(draw, sc.case.num_heads)
    return Expect()


@mutation("layer.alibi_slopes.bad")
def _(draw, sc):
    sc.layer_kw["alibi_slopes"] = bad_slopes(draw, sc.case.num_heads)
    return Expect()


def bad_slopes(draw, num_heads: int) -> object:
    good = standard_alibi_slopes(num_heads)
    which = draw(st.sampled_from(["inf", "nan", "shape", "string", "2d"]))
    if which in ("inf", "nan"):
        good[draw(st.integers(0, num_heads - 1))] = float(which)
        return good
    return {"shape": good[:-1] if num_heads > 1 else torch.ones(2), "string": "slopes", "2d": good[None]}[which]


@mutation("spec.attn_type.bad")
def _(draw, sc):
    sc.spec_kw["attn_type"] = draw(st.sampled_from(["bogus", None, 7, ["decoder"]]))
    return Expect()


@mutation("spec.attn_type.other")
def _(draw, sc):
    sc.spec_kw["attn_type"] = draw(st.sampled_from([t for t in T if t != sc.kind]))
    return EITHER  # e.g. an ENCODER_ONLY layer runs on a DECODER spec's fresh prompts


@mutation("layer.kv_cache_dtype.bad")
def _(draw, sc):
    sc.layer_kw["kv_cache_dtype"] = draw(st.sampled_from([None, "int4", ["auto"], torch.float8_e4m3fn]))
    return Expect()


@mutation("layer.kv_cache_dtype.other")
def _(draw, sc):
    sc.layer_kw["kv_cache_dtype"] = "fp8_e5m2" if sc.layer_kw["kv_cache_dtype"] == "auto" else "auto"
    return Expect(errors=VN, may_succeed=sc.kind in CACHELESS_TYPES)


# layer attention types that cannot run on this step (pairs where success is impossible)
TYPE_CLASHES = {
    T.DECODER: (T.ENCODER, T.ENCODER_DECODER),
    T.ENCODER_ONLY: (T.DECODER, T.ENCODER_DECODER, T.ENCODER),
    T.ENCODER: (T.DECODER, T.ENCODER_DECODER),
    # ENCODER_DECODER: none is sure to fail (encoder and decoder token counts may coincide)
}


@mutation("forward.attn_type.other", Needs(kinds=(T.DECODER, T.ENCODER_ONLY, T.ENCODER)))
def _(draw, sc):
    if not TYPE_CLASHES.get(sc.kind):
        return None
    sc.fwd["attn_type"] = draw(st.sampled_from(TYPE_CLASHES[sc.kind]))
    return Expect(errors=VN)


@mutation("forward.attn_type.bad")
def _(draw, sc):
    sc.fwd["attn_type"] = draw(st.sampled_from(["bogus", None, 7, 1.5]))
    return Expect()


@mutation("forward.attn_type.by_value")
def _(draw, sc):
    sc.fwd["attn_type"] = sc.kind.value  # "decoder", ...: the enum's value is accepted
    return OK


# --- builder arguments


def lens_field(draw, sc) -> str:
    fields = ["seq_lens", "query_lens"] + (["encoder_seq_lens"] if sc.build_kw["encoder_seq_lens"] else [])
    return draw(st.sampled_from(fields))


@mutation("build.lens.element_bad")
def _(draw, sc):
    field = lens_field(draw, sc)
    lens = sc.build_kw[field]
    i = draw(st.integers(0, len(lens) - 1))
    lens[i] = draw(st.sampled_from([float(lens[i]), None, str(lens[i]), 2**31, 2**63, True, [lens[i]],
                                    torch.tensor(float(lens[i]))]))
    return Expect()


@mutation("build.lens.element_range")
def _(draw, sc):
    field = lens_field(draw, sc)
    lens = sc.build_kw[field]
    i = draw(st.integers(0, len(lens) - 1))
    if field == "seq_lens":
        lens[i] = sc.build_kw["query_lens"][i] - 1  # fewer tokens than the new ones
    else:
        lens[i] = draw(st.sampled_from([0, -1]))
    return Expect()


@mutation("build.lens.numpy_or_tensor")
def _(draw, sc):
    field = lens_field(draw, sc)
    lens = sc.build_kw[field]
    sc.build_kw[field] = draw(st.sampled_from([np.asarray(lens), np.asarray(lens, dtype=np.int32),
                                               torch.tensor(lens), tuple(lens), [np.int64(x) for x in lens]]))
    return OK


@mutation("build.lens.container_bad")
def _(draw, sc):
    field = lens_field(draw, sc)
    lens = sc.build_kw[field]
    sc.build_kw[field] = draw(st.sampled_from([None, 5, "abc", {0: 1}, torch.tensor(lens, dtype=torch.float32),
                                               np.asarray(lens)[None], lens[:-1], lens + [1]]))
    return Expect()


@mutation("build.order.decode_first", Needs(mixed=True))
def _(draw, sc):
    q = sc.build_kw["query_lens"]
    decodes = [i for i, (s, n) in enumerate(zip(sc.build_kw["seq_lens"], q, strict=True)) if n == 1 and s > 1]
    if not decodes or decodes[-1] == 0 or len(q) < 2 or decodes[0] == 0:
        return None
    for field in ("seq_lens", "query_lens", "block_tables", "encoder_seq_lens", "cross_block_tables"):
        if sc.build_kw[field]:
            values = sc.build_kw[field]
            values.insert(0, values.pop(decodes[-1]))  # a decode moved before the prefills
    return Expect()


def table_expect(sc: Scenario, field: str, invalid: Expect) -> Expect:
    """Cacheless specs ignore block tables entirely; cross tables matter wherever they are given."""
    if field == "block_tables" and sc.kind in CACHELESS_TYPES:
        return OK
    return invalid


def tables_field(draw, sc) -> str:
    return draw(st.sampled_from(["block_tables"] + (["cross_block_tables"] if sc.build_kw["cross_block_tables"]
                                                    else [])))


def needed(sc: Scenario, field: str) -> list[int]:
    lens = sc.build_kw["seq_lens" if field == "block_tables" else "encoder_seq_lens"]
    return [-(-n // sc.case.block_size) for n in lens]


@mutation("build.table.entry_bad")
def _(draw, sc):
    field = tables_field(draw, sc)
    tables = sc.build_kw[field]
    i = draw(st.integers(0, len(tables) - 1))
    j = draw(st.integers(0, needed(sc, field)[i] - 1))
    nb = sc.case.num_blocks
    tables[i][j] = draw(st.sampled_from([nb, nb + 7, -1, -40, 2**31, 2**40, 2**70, float(tables[i][j]), None,
                                         str(tables[i][j]), True, np.float64(1)]))
    return table_expect(sc, field, Expect())


@mutation("build.table.duplicate", Needs(kinds=(T.DECODER, T.ENCODER_DECODER), long_table=True))
def _(draw, sc):
    field = tables_field(draw, sc)
    rows = [i for i, n in enumerate(needed(sc, field)) if n >= 2]
    if not rows:
        return None
    i = draw(st.sampled_from(rows))
    j, k = draw(st.lists(st.integers(0, needed(sc, field)[i] - 1), min_size=2, max_size=2, unique=True))
    sc.build_kw[field][i][j] = sc.build_kw[field][i][k]
    return table_expect(sc, field, Expect())


@mutation("build.table.names_a_written_block", Needs(kinds=(T.DECODER,), min_requests=2))
def _(draw, sc):
    # request j names a block that request i writes this step: two writers, or a reader of a write
    if sc.kind != T.DECODER or len(sc.build_kw["seq_lens"]) < 2:
        return None
    i, j = draw(st.lists(st.integers(0, len(sc.build_kw["seq_lens"]) - 1), min_size=2, max_size=2, unique=True))
    written = (sc.build_kw["seq_lens"][i] - 1) // sc.case.block_size  # i writes its last position
    k = draw(st.integers(0, needed(sc, "block_tables")[j] - 1))
    sc.build_kw["block_tables"][j][k] = sc.build_kw["block_tables"][i][written]
    return Expect()


@mutation("build.table.too_short")
def _(draw, sc):
    field = tables_field(draw, sc)
    tables = sc.build_kw[field]
    i = draw(st.integers(0, len(tables) - 1))
    del tables[i][needed(sc, field)[i] - 1 :]
    return table_expect(sc, field, Expect())


@mutation("build.table.past_need")
def _(draw, sc):
    # entries past a request's need are ignored: never checked, read or copied to the device
    field = tables_field(draw, sc)
    tables = sc.build_kw[field]
    i = draw(st.integers(0, len(tables) - 1))
    tables[i] = tables[i][: needed(sc, field)[i]] + draw(st.lists(
        st.sampled_from([999, -40, 2**40, 2**70, "x", None, 2.5, -1, True]), min_size=1, max_size=3))
    return OK


@mutation("build.tables.container_bad")
def _(draw, sc):
    field = tables_field(draw, sc)
    tables = sc.build_kw[field]
    sc.build_kw[field] = draw(st.sampled_from([None, 5, "abc", tables[:-1], tables + [[0]],
                                               [5] + tables[1:], [None] + tables[1:]]))
    return table_expect(sc, field, Expect())


@mutation("build.tables.arrays_or_tuples")
def _(draw, sc):
    field = tables_field(draw, sc)
    tables = sc.build_kw[field]
    how = draw(st.sampled_from(["numpy_rows", "tuples", "tensor_rows"]))
    sc.build_kw[field] = {"numpy_rows": [np.asarray(t, dtype=np.int64) for t in tables],
                          "tuples": tuple(tuple(t) for t in tables),
                          "tensor_rows": [torch.tensor(t, dtype=torch.int64) for t in tables]}[how]
    return OK


@mutation("build.encoder.missing", Needs(kinds=(T.ENCODER, T.ENCODER_DECODER)))
def _(draw, sc):
    if sc.kind not in (T.ENCODER, T.ENCODER_DECODER):
        return None
    sc.build_kw[draw(st.sampled_from(["encoder_seq_lens", "cross_block_tables"]
                                     if sc.kind == T.ENCODER_DECODER else ["encoder_seq_lens"]))] = None
    return Expect()


# --- forward tensors and arguments


TENSORS = ("query", "key", "value")


def present(sc: Scenario) -> list[str]:
    return [n for n in TENSORS if sc.fwd[n] is not None]


@mutation("forward.tensor.type")
def _(draw, sc):
    name = draw(st.sampled_from(present(sc)))
    t = sc.fwd[name]
    sc.fwd[name] = draw(st.sampled_from([None, (t if t.dtype != torch.bfloat16 else t.float()).cpu().numpy(),
                                         t.tolist(), 3.0, "query"]))
    if sc.fwd[name] is None and name != "query" and sc.kind == T.ENCODER_DECODER and not sc.batch_has_prefill:
        return None  # a decode-only cross step takes key=value=None
    return Expect()


@mutation("forward.tensor.rows")
def _(draw, sc):
    name = draw(st.sampled_from(present(sc)))
    t = sc.fwd[name]
    sc.fwd[name] = t[:-1] if draw(st.booleans()) else torch.cat([t, t[:1]])
    return Expect()


@mutation("forward.tensor.width")
def _(draw, sc):
    name = draw(st.sampled_from(present(sc)))
    t = sc.fwd[name]
    sc.fwd[name] = t[:, :-1] if draw(st.booleans()) else torch.cat([t, t[:, : sc.case.head_size]], dim=1)
    return Expect()


@mutation("forward.tensor.rank")
def _(draw, sc):
    name = draw(st.sampled_from(present(sc)))
    t = sc.fwd[name]
    sc.fwd[name] = draw(st.sampled_from([t[None], t.view(t.shape[0], -1, sc.case.head_size), t.flatten()]))
    return Expect()


@mutation("forward.tensor.dtype")
def _(draw, sc):
    name = draw(st.sampled_from(present(sc)))
    t = sc.fwd[name]
    dtype = draw(st.sampled_from([d for d in (torch.float64, torch.int32, torch.float16, torch.bfloat16,
                                              torch.float32) if d != t.dtype]))
    sc.fwd[name] = t.to(dtype)
    return Expect()


@mutation("forward.tensor.device")
def _(draw, sc):
    name = draw(st.sampled_from(present(sc)))
    sc.fwd[name] = sc.fwd[name].to("meta")
    return Expect()


@mutation("forward.tensor.strided")
def _(draw, sc):
    # a column slice of a wider tensor (a fused projection's output): same values, row stride > width
    name = draw(st.sampled_from(present(sc)))
    t = sc.fwd[name]
    wide = torch.cat([t, torch.full_like(t, math.nan)], dim=1)
    sc.fwd[name] = wide[:, : t.shape[1]]
    return OK


@mutation("forward.key_value.none", Needs(has_prefill=True))
def _(draw, sc):
    if sc.fwd["key"] is None:
        return None
    sc.fwd["key"] = sc.fwd["value"] = None  # only a decode-only cross step may omit them
    return Expect()


@mutation("forward.key_value.one_none", Needs(has_prefill=True))
def _(draw, sc):
    if sc.fwd["key"] is None:
        return None
    sc.fwd[draw(st.sampled_from(["key", "value"]))] = None
    return Expect()


@mutation("forward.kv_cache.bad", Needs(kinds=(T.DECODER, T.ENCODER_DECODER)))
def _(draw, sc):
    cache = sc.fwd["kv_cache"]
    if cache is None:
        return None
    nb, bs = cache.shape[1], cache.shape[2]
    options = {
        "none": None,
        "numpy": cache.float().cpu().numpy(),
        "rank4": cache[0],
        "fewer_blocks": cache[:, :-1].clone(),
        "more_blocks": torch.cat([cache, cache[:, :1]], dim=1),
        "strided": torch.cat([cache, cache], dim=-1)[..., : cache.shape[-1]],  # the right shape, not contiguous
        "float64": cache.double(),
        "meta": cache.to("meta"),
        "heads_swapped": cache.transpose(3, 4).contiguous(),
    }
    if bs % 2 == 0:
        options["other_block_size"] = cache.reshape(2, nb * 2, bs // 2, *cache.shape[3:])
    options["other_cache_dtype"] = cache.to(torch.float8_e4m3fn if cache.dtype.itemsize > 1 else torch.bfloat16)
    sc.fwd["kv_cache"] = options[draw(st.sampled_from(sorted(options)))]
    return Expect()


@mutation("forward.kv_cache.given_to_cacheless", Needs(kinds=(T.ENCODER, T.ENCODER_ONLY)))
def _(draw, sc):
    if sc.kind not in CACHELESS_TYPES:
        return None
    sc.fwd["kv_cache"] = sc.batch.kv_cache  # never written, never read
    return OK


@mutation("forward.scales.bad")
def _(draw, sc):
    sc.fwd[draw(st.sampled_from(["k_scale", "v_scale"]))] = bad_real(draw)
    return Expect()


@mutation("forward.scales.numpy_or_tensor")
def _(draw, sc):
    name = draw(st.sampled_from(["k_scale", "v_scale"]))
    sc.fwd[name] = draw(st.sampled_from([np.float64(sc.fwd[name]), torch.tensor(sc.fwd[name]),
                                         np.float32(sc.fwd[name])]))
    return OK


@mutation("forward.metadata.not_metadata")
def _(draw, sc):
    other = draw(st.sampled_from([None, "md", {"slot_mapping": None}, 3]))
    sc.metadata = lambda md, spec, backend: other
    return Expect()


@mutation("forward.metadata.renamed")
def _(draw, sc):
    name = draw(st.sampled_from(["XFORMERS", "FLASHINFER", "TORCH_SDPA", ""]))
    if name == sc.backend.get_name():
        return None
    sc.metadata = lambda md, spec, backend: dataclasses.replace(md, backend_name=name)
    return Expect()


@mutation("forward.metadata.other_backend")
def _(draw, sc):
    # metadata of a real other builder for the same step (its own fields, its own checks)
    others = [b for n, b in BACKEND_CLASSES().items() if n != sc.backend.get_name()]
    other = draw(st.sampled_from(others))

    def swap(md, spec, backend):
        try:
            return other.get_builder_cls()(spec).build(**sc.build_kw)
        except (ValueError, NotImplementedError):
            return dataclasses.replace(md, backend_name=other.get_name())  # its builder refuses this spec

    sc.metadata = swap
    return Expect()


@mutation("forward.metadata.other_num_blocks")
def _(draw, sc):
    def rebuild(md, spec, backend):
        return backend.get_builder_cls()(dataclasses.replace(spec, num_blocks=spec.num_blocks + 1)).build(
            **sc.build_kw)

    sc.metadata = rebuild
    return Expect(may_succeed=sc.kind in CACHELESS_TYPES)  # cacheless steps have no blocks


@mutation("forward.metadata.other_step", Needs(min_requests=2))
def _(draw, sc):
    kw = sc.build_kw
    if len(kw["seq_lens"]) < 2:
        return None

    def rebuild(md, spec, backend):  # the same step without its last request
        return backend.get_builder_cls()(spec).build(**{k: None if v is None else v[:-1] for k, v in kw.items()})

    sc.metadata = rebuild
    return Expect()


@mutation("forward.metadata.cacheless_spec", Needs(fresh=True))
def _(draw, sc):
    if sc.kind not in CACHE_WRITING_TYPES or any(s != q for s, q in zip(sc.case.seq_lens, sc.case.query_lens,
                                                                         strict=True)):
        return None

    def rebuild(md, spec, backend):
        return backend.get_builder_cls()(dataclasses.replace(spec, attn_type=T.ENCODER_ONLY)).build(**sc.build_kw)

    sc.metadata = rebuild
    return Expect(errors=VN)


@mutation("backend.name")
def _(draw, sc):
    name = sc.backend.get_name()
    sc.name = draw(st.sampled_from([3, "nope", name.lower(), [name], ""]))
    # a lower-case name is the backend; FLASHINFER / XFORMERS on a machine without CUDA cannot run
    return Expect(errors=VR, may_succeed=sc.name in (name.lower(), ""))  # "": the best backend here


@mutation("none")
def _(draw, sc):
    return OK


# the ca.Attention path only


@mutation("context.outside")
def _(draw, sc):
    sc.in_context = False
    return Expect(errors=(RuntimeError,))


LAYER_ONLY = ("context.outside",)


# -------------------------------------------------------------------------------------------
# Running a scenario and checking the outcome


def resolve(sc: Scenario) -> type[ca.AttentionBackend]:
    if sc.name == sc.backend.get_name():
        return sc.backend  # the class itself: FLASHINFER / XFORMERS stand-ins run on CPU too
    return ca.get_attn_backend(sc.name)


def run_impl(sc: Scenario):
    backend = resolve(sc)
    spec = ca.AttentionSpec(**sc.spec_kw)
    md = backend.get_builder_cls()(spec).build(**sc.build_kw)
    if sc.metadata is not None:
        md = sc.metadata(md, spec, backend)
    impl = backend.get_impl_cls()(**sc.layer_kw)
    return impl.forward(attn_metadata=md, **sc.fwd), impl, md


def run_layer(sc: Scenario):
    spec = ca.AttentionSpec(**sc.spec_kw)
    backend = resolve(sc)
    md = backend.get_builder_cls()(spec).build(**sc.build_kw)
    if sc.metadata is not None:
        md = sc.metadata(md, spec, backend)
    f = sc.fwd
    layer = ca.Attention(**sc.layer_kw, attn_type=f["attn_type"], backend=sc.name, k_scale=f["k_scale"],
                         v_scale=f["v_scale"])
    with ca.set_forward_context(md) if sc.in_context else contextlib.nullcontext():
        out = layer(f["query"], f["key"], f["value"], f["kv_cache"])
    return out, layer.impl, md


def stand_ins(backend: type[ca.AttentionBackend], device: str) -> contextlib.AbstractContextManager:
    """On CPU, FLASHINFER and XFORMERS run everything but their kernels (dense float64 stand-ins)."""
    stack = contextlib.ExitStack()
    if device == "cpu" and backend.get_name() == "FLASHINFER":
        stack.enter_context(unittest.mock.patch.object(fib, "_flashinfer", lambda: DENSE_FLASHINFER))
        stack.enter_context(unittest.mock.patch.object(fib, "WORKSPACE_BYTES", 1024))
    if device == "cpu" and backend.get_name() == "XFORMERS":
        stack.enter_context(unittest.mock.patch.object(xformers_ops, "run_xformers", dense_float64_kernel))
    return stack


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included) of tensors of any layout."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu().reshape(-1).view(torch.uint8),
                                                                     b.cpu().reshape(-1).view(torch.uint8))


def watched(*objects: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, snapshot) of every real (not meta) tensor among `objects`, deduplicated."""
    out, seen = [], set()
    for t in objects:
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and id(t) not in seen:
            seen.add(id(t))
            out.append((t, t.clone()))
    return out


def check_outcome(name: str, expect: Expect, run: Callable[[], object], watch: list, on_success: Callable) -> str:
    """Run one mutated call and check it against `expect`; returns "error" or "ok"."""
    registered = len(forward_context._layers)
    try:
        result = run()
    except (ValueError, NotImplementedError, RuntimeError) as e:
        if not isinstance(e, expect.errors):
            raise AssertionError(f"{name}: {type(e).__name__} is not among {expect.errors}: {e}") from e
        for t, before in watch:
            assert same_bits(t, before), f"{name}: {type(e).__name__} raised after a cache was written: {e}"
        assert no_context(), f"{name}: a forward context was left set"
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    if error is not None:  # the traceback (and the layers its frames held) is gone here
        assert len(forward_context._layers) <= registered, f"{name}: a layer registration was left behind ({error})"
        return "error"
    assert expect.may_succeed, f"{name}: accepted silently (expected {expect.errors})"
    assert no_context(), f"{name}: a forward context was left set"
    on_success(result)
    return "ok"


def check_forward_success(sc: Scenario, before: torch.Tensor | None):
    """Success: each request's output equals the float64 reference of the layer's effective options,
    and the cache changed exactly at this step's slots (cacheless types: not at all)."""

    def check(result) -> None:
        out, impl, md = result
        kind = ca.AttentionType(sc.fwd["attn_type"])
        k_scale, v_scale = float(sc.fwd["k_scale"]), float(sc.fwd["v_scale"])
        ref = reference_forward(sc.batch, kind, scale=impl.scale, sliding_window=impl.sliding_window,
                                logits_soft_cap=impl.logits_soft_cap, alibi=impl.alibi_slopes, k_scale=k_scale,
                                v_scale=v_scale)
        got = out.cpu()
        assert got.shape == ref.shape, f"output {tuple(got.shape)} != {tuple(ref.shape)}"
        tol = tolerance(sc.case, sc.device)
        rows = request_rows(sc.case)
        for i, (o, r) in enumerate(zip(got.split(rows), ref.split(rows), strict=True)):
            assert rel_err(o, r) <= tol, f"request {i}: rel err {rel_err(o, r):.2e} > {tol:.0e}"
        cache = sc.fwd["kv_cache"]
        if before is None:
            return
        expect = before.to("cpu", copy=True)
        if kind in CACHE_WRITING_TYPES and sc.fwd["key"] is not None:
            slots = (md.cross_slot_mapping if kind == T.ENCODER_DECODER else md.slot_mapping).cpu()
            keep = slots >= 0
            shape = (-1, sc.case.num_kv_heads, sc.case.head_size)
            flat = expect.view(2, -1, *shape[1:])
            flat[0, slots[keep]] = stored(sc.fwd["key"].cpu().reshape(shape)[keep], expect.dtype, k_scale)
            flat[1, slots[keep]] = stored(sc.fwd["value"].cpu().reshape(shape)[keep], expect.dtype, v_scale)
        assert same_bits(cache.cpu(), expect), "the cache changed beyond this step's slots"

    return check


COUNTS: collections.Counter = collections.Counter()  # (path, backend, device, mutation, outcome) -> examples


@pytest.fixture(autouse=True, scope="module")
def report_counts():
    """FUZZ_REPORT=path: at the end, append this process's examples per (device, backend, path,
    outcome) to `path` as one JSON line (a line per pytest-xdist worker; gpu_check.sh sums them)."""
    yield
    path = os.environ.get("FUZZ_REPORT")
    if path and COUNTS:
        totals = collections.Counter()
        for (route, backend, device, _, outcome), n in COUNTS.items():
            totals[f"{device} {backend} {route} {outcome}"] += n
        with open(path, "a") as f:
            f.write(json.dumps(totals) + "\n")


def fuzz_forward(draw, backend: type[ca.AttentionBackend], device: str, path: str, name: str) -> None:
    sc = scenario(draw(tiny_cases(backend, device, NEEDS[name])), backend, device)
    expect = CATALOGUE[name](draw, sc)
    assume(expect is not None)  # rare: the mutation does not apply to this step
    cache = sc.fwd["kv_cache"] if isinstance(sc.fwd["kv_cache"], torch.Tensor) else None
    watch = watched(sc.batch.kv_cache, cache)
    before = cache.clone() if cache is not None and cache.device.type != "meta" else None
    runner = run_layer if path == "layer" else run_impl
    with stand_ins(backend, device):
        outcome = check_outcome(name, expect, lambda: runner(sc), watch, check_forward_success(sc, before))
    COUNTS[(path, backend.get_name(), device, name, outcome)] += 1


def mutations_for(backend: type[ca.AttentionBackend], path: str) -> list[str]:
    """The catalogue entries this backend's steps can take (their attention types), on this path."""
    return [m for m in CATALOGUE if (path == "layer" or m not in LAYER_ONLY)
            and (NEEDS[m].kinds is None or set(NEEDS[m].kinds) & set(backend.supported_attn_types))]


def forward_params(plan: list[tuple[str, str, int]], **marks) -> list:
    return [pytest.param(name, path, m, n, id=f"{name}-{path}-{m}", **marks)
            for name, path, n in plan for m in mutations_for(BACKEND_CLASSES()[name], path)]


# -------------------------------------------------------------------------------------------
# Forward paths: every mutation of the catalogue is its own test, so each runs every time


# (backend, path, examples per mutation): > 1,900 examples in all on CPU
CPU_PLAN = [("TORCH_SDPA", "impl", 10), ("TORCH_SDPA", "layer", 6), ("FLASHINFER", "impl", 4),
            ("XFORMERS", "impl", 4)]
# >= 300 per backend through impl.forward (4 per mutation), one per mutation through ca.Attention
GPU_PLAN = [(name, path, n) for name in BACKEND_CLASSES() for path, n in (("impl", 4), ("layer", 1))]


@pytest.mark.parametrize(("name", "path", "mutation", "default"), forward_params(CPU_PLAN))
def test_mutated_forward_raises_the_documented_error_or_is_correct(name, path, mutation, default):
    backend = BACKEND_CLASSES()[name]
    if name == "XFORMERS":
        pytest.importorskip("xformers.ops.fmha")

    @fuzz_settings(examples(default))
    @given(st.data())
    def fuzz(data):
        fuzz_forward(data.draw, backend, "cpu", path, mutation)

    fuzz()


@pytest.mark.parametrize(("name", "path", "mutation", "default"), forward_params(GPU_PLAN, marks=pytest.mark.gpu))
def test_mutated_forward_on_the_device(name, path, mutation, default, monkeypatch):
    backend = available(name, "cuda")
    # a mutated step may be FlashInfer metadata of a variant no test builds (an uncached JIT build
    # in build()); left to its first use, the op refuses it before any plan
    monkeypatch.setattr(fib, "plans_in_build", lambda spec: False)

    @fuzz_settings(examples(default))
    @given(st.data())
    def fuzz(data):
        fuzz_forward(data.draw, backend, "cuda", path, mutation)

    fuzz()


# -------------------------------------------------------------------------------------------
# The graph State's refill (TORCH_SDPA on CPU; every backend on the device)


GRAPH_MUTATIONS = ["none", "prefill", "too_many", "overlong", "renamed", "other_num_blocks", "host_table_bad",
                   "host_table_missing", "not_metadata", "past_need"]
GRAPH_MAX_LEN = 16


def fuzz_graph(draw, backend, device: str, name: str) -> None:
    """A decode-only step refilled into a State captured for bs >= its requests, one mutation."""
    case = draw(tiny_cases(backend, device).filter(lambda c: c.kind == T.DECODER and c.kv_cache_dtype == "auto"
                                                   and not c.alibi))
    n = len(case.seq_lens)
    bs = n + draw(st.integers(0, 2))
    per_request = -(-(GRAPH_MAX_LEN + 1) // case.block_size)
    case = dataclasses.replace(case, query_lens=(1,) * n, num_blocks=(bs + 3) * per_request,
                               seq_lens=tuple(max(2, min(s, GRAPH_MAX_LEN)) for s in case.seq_lens))
    spec = dataclasses.replace(case.spec(device), max_seq_len_to_capture=GRAPH_MAX_LEN)
    state = backend.get_state_cls()(spec)
    with state.graph_capture(bs):
        md_bs = state.graph_capture_get_metadata_for_batch(bs)
        bufs = state.get_graph_input_buffers(md_bs)
        graph_state = state.graph_clone(bs)
    batch = make_batch(spec, list(case.seq_lens), list(case.query_lens), seed=case.seed)
    seq_lens, query_lens = list(case.seq_lens), list(case.query_lens)
    tables = [list(t) for t in batch.block_tables]
    unused = [b for b in range(spec.num_blocks) if all(b not in t for t in tables)]
    expect, md_spec = Expect(), spec
    if name == "prefill":
        query_lens[0] = 2  # a chunk over cached context: a prefill
    elif name == "too_many":
        seq_lens, query_lens = [2] * (bs + 1), [1] * (bs + 1)
        need = -(-2 // spec.block_size)
        tables = [list(range(i * need, (i + 1) * need)) for i in range(bs + 1)]
    elif name == "overlong":
        seq_lens[0] = GRAPH_MAX_LEN + 1
        tables[0] = tables[0] + unused[: per_request - len(tables[0])]
    elif name == "other_num_blocks":
        md_spec = dataclasses.replace(spec, num_blocks=spec.num_blocks + 1)
    elif name == "past_need":
        tables[0] = tables[0] + [999, -40, 2**40, "x"]
        expect = OK
    elif name == "none":
        expect = OK

    def step():
        md = backend.get_builder_cls()(md_spec).build(seq_lens, query_lens, tables)
        if name == "renamed":
            md = dataclasses.replace(md, backend_name="NOT_" + backend.get_name())
        elif name == "host_table_bad":  # the host table the device one was made from, edited after build
            md.block_tables_host[0, 0] = draw(st.sampled_from([spec.num_blocks, -1, 2**31 - 1]))
        elif name == "host_table_missing":
            md = dataclasses.replace(md, block_tables_host=None)
        elif name == "not_metadata":
            md = {"slot_mapping": md.slot_mapping}
        graph_state.prepare_graph_input_buffers(bufs, md)
        graph_state.begin_forward(md)
        return md

    def after(md) -> None:
        # what a replay runs, eagerly over the static buffers: live rows equal the reference,
        # pad rows (NaN K/V) write nothing
        impl = backend.get_impl_cls()(spec.num_heads, spec.head_size, spec.softmax_scale, spec.num_kv_heads,
                                      sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap)

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.full((bs - n, x.shape[1]), math.nan, dtype=x.dtype, device=x.device)])

        cache = batch.kv_cache
        eager_cache = cache.clone()
        impl.forward(batch.query, batch.key, batch.value, eager_cache, md)
        out = impl.forward(padded(batch.query), padded(batch.key), padded(batch.value), cache, md_bs)[:n]
        ref = reference_forward(batch, sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap)
        tol = tolerance(case, device)
        for i, (o, r) in enumerate(zip(out.cpu().split(1), ref.split(1), strict=True)):
            assert rel_err(o, r) <= tol, f"graph step request {i}: rel err {rel_err(o, r):.2e}"
        assert same_bits(cache, eager_cache), "pad rows wrote into the cache"

    with stand_ins(backend, device):
        outcome = check_outcome(f"graph.{name}", expect, step, watched(batch.kv_cache, *bufs.values()), after)
    COUNTS[("graph", backend.get_name(), device, name, outcome)] += 1


@pytest.mark.parametrize("mutation", GRAPH_MUTATIONS)
def test_mutated_graph_refill_raises_before_any_buffer_is_written_or_is_correct(mutation):
    @fuzz_settings(examples(20))
    @given(st.data())
    def fuzz(data):
        fuzz_graph(data.draw, SDPA, "cpu", mutation)

    fuzz()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BACKEND_CLASSES()))
@pytest.mark.parametrize("mutation", GRAPH_MUTATIONS)
def test_mutated_graph_refill_on_the_device(name, mutation):
    backend = available(name, "cuda")

    @fuzz_settings(examples(10))
    @given(st.data())
    def fuzz(data):
        fuzz_graph(data.draw, backend, "cuda", mutation)

    fuzz()


# -------------------------------------------------------------------------------------------
# Block copies and swaps


BLOCK_MUTATIONS = ["none", "pairs_dtype", "pairs_shape", "pairs_type", "src_out_of_range", "dst_out_of_range",
                   "duplicate_dst", "caches_type", "cache_rank", "cache_listed_twice", "chain", "swap_mismatch"]


def copy_reference(caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Every source read before any destination is written, once per distinct cache."""
    out = {}
    for c in caches:
        if id(c) not in out:
            new = c.clone()
            src = c.clone()
            for s, d in pairs:
                new[:, d] = src[:, s]
            out[id(c)] = new
    return [out[id(c)] for c in caches]


def fuzz_blocks(draw, device: str, name: str) -> None:
    """copy_blocks or swap_blocks on random caches and pairs (distinct destinations), one mutation."""
    op = draw(st.sampled_from(["copy", "swap"]))
    nb, bs, hkv, d = draw(st.integers(3, 8)), draw(st.sampled_from([1, 4])), draw(st.integers(1, 2)), 8
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def cache(num_blocks: int = nb) -> torch.Tensor:
        return torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(dtype).to(device)

    originals = [cache() for _ in range(draw(st.integers(1, 3)))]
    src, dst = cache(), cache(draw(st.integers(2, 8)))
    watch = watched(*originals, src, dst)
    caches = list(originals)
    top = nb if op == "copy" else dst.shape[1]
    dsts = draw(st.lists(st.integers(0, top - 1), min_size=1, max_size=min(top, 4), unique=True))
    pairs = [(draw(st.integers(0, nb - 1)), x) for x in dsts]
    tensor = torch.tensor(pairs, dtype=torch.int64)
    expect = Expect()
    if name == "pairs_dtype":
        tensor = tensor.to(draw(st.sampled_from([torch.int32, torch.float32, torch.bool, torch.uint8])))
    elif name == "pairs_shape":
        tensor = draw(st.sampled_from([tensor.flatten(), tensor[:, :1], torch.cat([tensor, tensor[:, :1]], 1),
                                       tensor[None]]))
    elif name == "pairs_type":
        tensor = draw(st.sampled_from([pairs, np.asarray(pairs), None, tuple(pairs)]))
    elif name == "src_out_of_range":
        tensor[0, 0] = draw(st.sampled_from([nb, -1, 2**40]))
    elif name == "dst_out_of_range":
        tensor[0, 1] = draw(st.sampled_from([top, -1, 2**40]))
    elif name == "duplicate_dst":
        tensor = torch.cat([tensor, torch.tensor([[draw(st.integers(0, nb - 1)), dsts[0]]])])
    elif name == "caches_type":
        caches = draw(st.sampled_from([originals[0], (*originals, "x"), None, [None]]))
        src = draw(st.sampled_from([src.float().cpu().numpy(), None, [src]]))
    elif name == "cache_rank":
        bad = draw(st.sampled_from([originals[0][0], originals[0].flatten(2),
                                    torch.cat([originals[0], originals[0][:1]])]))
        caches[draw(st.integers(0, len(caches) - 1))] = bad
        src = bad
    elif name == "cache_listed_twice":  # read-before-write across the whole list
        caches = [originals[0], *originals, originals[0]]
        expect = OK
    elif name == "chain":  # 0 -> 1, 1 -> 2: block 2 gets block 1's old contents
        pairs = [(0, 1), (1, 2)] if op == "copy" else [(0, 1), (1, 0)]
        tensor = torch.tensor(pairs)
        expect = OK
    elif name == "swap_mismatch":
        other = torch.randn(2, dst.shape[1], bs, hkv, d + 1, generator=g).to(dtype)
        dst = draw(st.sampled_from([dst.float() if dst.dtype != torch.float32 else dst.double(), other, dst[0]]))
        expect = Expect() if op == "swap" else OK  # copy ignores dst
    else:
        expect = OK
    if op == "copy":
        want = copy_reference(caches, pairs) if expect.may_succeed else None

        def run():
            SDPA.copy_blocks(caches, tensor)

        def after(_):
            assert all(same_bits(c, w) for c, w in zip(caches, want, strict=True)), "copy_blocks copied wrongly"
    else:
        want = dst.clone() if expect.may_succeed else None
        for s_, t_ in pairs if expect.may_succeed else ():
            want[:, t_] = src[:, s_]

        def run():
            SDPA.swap_blocks(src, dst, tensor)

        def after(_):
            assert same_bits(dst, want), "swap_blocks copied wrongly"
    outcome = check_outcome(f"blocks.{op}.{name}", expect, run, watch, after)
    COUNTS[("blocks", "any", device, name, outcome)] += 1


@pytest.mark.parametrize("mutation", BLOCK_MUTATIONS)
def test_mutated_block_ops_raise_before_copying_or_copy_exactly(mutation):
    @fuzz_settings(examples(25))
    @given(st.data())
    def fuzz(data):
        fuzz_blocks(data.draw, "cpu", mutation)

    fuzz()


# -------------------------------------------------------------------------------------------
# ca.Attention compiled (one compile; mutations that change no traced shape)


COMPILED_MUTATIONS = ["none", "query_rows", "key_rows", "renamed", "other_num_blocks", "other_step", "outside",
                      "cacheless_spec"]


@pytest.fixture(scope="module")
def compiled_layer():
    torch._dynamo.reset()
    layer = ca.Attention(4, 8, 8**-0.5, num_kv_heads=2, backend="TORCH_SDPA")
    return layer, torch.compile(layer, fullgraph=True, dynamic=True)


@pytest.mark.parametrize("mutation", COMPILED_MUTATIONS)
def test_mutated_compiled_layer_raises_the_documented_error_or_is_correct(compiled_layer, mutation):
    layer, compiled = compiled_layer
    name = mutation

    @fuzz_settings(examples(5))
    @given(st.data())
    def fuzz(data):
        draw = data.draw
        needs = Needs(kinds=(T.DECODER,), fresh=name == "cacheless_spec", min_requests=2 if name == "other_step" else 1)
        # one shape family (the cache's sizes fixed, token counts unbacked): one compile serves every example
        case = dataclasses.replace(draw(tiny_cases(SDPA, "cpu", needs)), dtype="float32", num_heads=4, num_kv_heads=2,
                                   head_size=8, sliding_window=None, logits_soft_cap=None, alibi=False, block_size=4,
                                   num_blocks=48)
        sc = scenario(case, SDPA, "cpu")
        expect = Expect()
        f = sc.fwd
        if name == "query_rows":
            f["query"] = f["query"][:-1] if draw(st.booleans()) else torch.cat([f["query"], f["query"][:1]])
        elif name == "key_rows":
            f["key"], f["value"] = f["key"][:-1], f["value"][:-1]
        elif name == "renamed":
            sc.metadata = lambda md, spec, backend: dataclasses.replace(md, backend_name="FLASHINFER")
        elif name == "other_num_blocks":
            sc.metadata = lambda md, spec, backend: backend.get_builder_cls()(
                dataclasses.replace(spec, num_blocks=spec.num_blocks + 1)).build(**sc.build_kw)
        elif name == "other_step":
            sc.metadata = lambda md, spec, backend: backend.get_builder_cls()(spec).build(
                **{k: None if v is None else v[:-1] for k, v in sc.build_kw.items()})
        elif name == "outside":
            sc.in_context = False
            expect = Expect(errors=(RuntimeError,))
        elif name == "cacheless_spec":
            sc.metadata = lambda md, spec, backend: backend.get_builder_cls()(
                dataclasses.replace(spec, attn_type=T.ENCODER_ONLY)).build(**sc.build_kw)
        else:
            expect = OK
        before = f["kv_cache"].clone()

        def run():
            spec = ca.AttentionSpec(**sc.spec_kw)
            md = SDPA.get_builder_cls()(spec).build(**sc.build_kw)
            md = sc.metadata(md, spec, SDPA) if sc.metadata else md
            args = f["query"], f["key"], f["value"], f["kv_cache"]
            ca.mark_token_dim(*args[:3])
            with ca.set_forward_context(md) if sc.in_context else contextlib.nullcontext():
                return compiled(*args), layer.impl, md

        outcome = check_outcome(f"compiled.{name}", expect, run, watched(f["kv_cache"]),
                                check_forward_success(sc, before))
        COUNTS[("compiled", "TORCH_SDPA", "cpu", name, outcome)] += 1

    fuzz()


def test_catalogue_names_an_argument_of_every_entry_point():
    # the families the issue names: every argument of every public entry point
    families = {name.split(".")[0] for name in CATALOGUE}
    assert families >= {"spec", "layer", "build", "forward", "backend", "context"}
    spec_fields = {f.name for f in dataclasses.fields(ca.AttentionSpec)} - {"kv_cache_dtype", "scale",
                                                                           "sliding_window", "logits_soft_cap",
                                                                           "alibi_slopes", "attn_type", "dtype",
                                                                           "device"}
    assert all(f"spec.{f}.bad" in CATALOGUE for f in spec_fields)

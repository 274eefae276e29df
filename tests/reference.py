"""The float64 reference every backend is checked against, random paged batches, and a Dynamo
backend that records graph inputs.

Plain torch, one request at a time, over the *logical* key sequence (no paging), so it shares
no code with the backends. Batches come with a cache whose every unused slot holds NaN: real
caches come from torch.empty, and garbage outside a request's tokens must never reach it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

import compiled_attn as ca

T = TypeVar("T")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes for a power-of-two head count (2^(-8 i / n))."""
    return torch.tensor([2 ** (-8 * (i + 1) / num_heads) for i in range(num_heads)])


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request. q: [Lq, Hq, D], k/v: [Lk, Hkv, D], q_pos: [Lq] positions among the keys.

    Returns [Lq, Hq, D] float64. Soft-cap and ALiBi act on the scaled scores before masking;
    a window W lets position p see keys p-W+1 .. p.
    """
    hq, hkv = q.shape[1], k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    kpos = torch.arange(k.shape[0], dtype=torch.float64)
    rel = kpos[None, :] - q_pos.double()[:, None]  # [Lq, Lk]
    if alibi is not None:
        scores = scores + alibi.double()[:, None, None] * rel[None]
    mask = torch.ones_like(rel, dtype=torch.bool)
    if causal:
        mask &= rel <= 0
    if sliding_window is not None:
        mask &= rel > -sliding_window
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def stored(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a cache of `cache_dtype` holds for x (fp8: x / scale, rounded)."""
    if cache_dtype.itemsize == 1:
        return (x.float() / scale).to(cache_dtype)
    return x.to(cache_dtype)


def round_trip(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a cache of `cache_dtype` gives back for x (fp8: multiplied back by the scale)."""
    if cache_dtype.itemsize == 1:
        return stored(x, cache_dtype, scale).float() * scale
    return x.to(cache_dtype)


@dataclasses.dataclass
class Batch:
    """A random paged batch: new tokens, a cache holding the context, and the logical history."""

    spec: ca.AttentionSpec
    seq_lens: list[int]
    query_lens: list[int]
    block_tables: list[list[int]]
    query: torch.Tensor  # [num_tokens, Hq * D]
    key: torch.Tensor  # [num_tokens, Hkv * D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D], NaN outside the context
    k_hist: list[torch.Tensor]  # per request [seq_len, Hkv, D]: context + new keys
    v_hist: list[torch.Tensor]
    encoder_seq_lens: list[int] | None = None
    cross_block_tables: list[list[int]] | None = None
    enc_k: list[torch.Tensor] | None = None  # per request [encoder_seq_len, Hkv, D]
    enc_v: list[torch.Tensor] | None = None
    enc_q: list[torch.Tensor] | None = None  # per request [encoder_seq_len, Hq, D] (ENCODER)

    def build(self, backend: type[ca.AttentionBackend]) -> ca.AttentionMetadata:
        return backend.get_builder_cls()(self.spec).build(
            self.seq_lens, self.query_lens, self.block_tables,
            encoder_seq_lens=self.encoder_seq_lens, cross_block_tables=self.cross_block_tables,
        )

    def encoder_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder K/V of the prefills, as cross attention's key/value on their first step."""
        num_prefills = sum(1 for s, q in zip(self.seq_lens, self.query_lens, strict=True)
                           if not (q == 1 and s > 1))
        k = torch.cat(self.enc_k[:num_prefills]).flatten(1)
        v = torch.cat(self.enc_v[:num_prefills]).flatten(1)
        return k, v

    def encoder_query(self) -> torch.Tensor:
        """Queries of ENCODER attention: the encoder tokens, [num_encoder_tokens, Hq * D]."""
        return torch.cat(self.enc_q).flatten(1).to(self.spec.device)


def allocate_blocks(
    counts: list[int], num_blocks: int, generator: torch.Generator, top: bool = False
) -> list[list[int]]:
    """Distinct random blocks per request; `top` draws from the highest ids (offset overflow)."""
    need = sum(counts)
    if need > num_blocks:
        raise ValueError(f"batch needs {need} blocks, the cache has {num_blocks}")
    pool = torch.randperm(need if top else num_blocks, generator=generator)[:need]
    if top:
        pool = pool + (num_blocks - need)
    out, at = [], 0
    for n in counts:
        out.append(pool[at : at + n].tolist())
        at += n
    return out


def make_batch(
    spec: ca.AttentionSpec,
    seq_lens: list[int],
    query_lens: list[int],
    *,
    seed: int = 0,
    encoder_seq_lens: list[int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    top_blocks: bool = False,
    fill: float = float("nan"),
) -> Batch:
    """Random inputs for `spec`; the cache holds each request's context (seq_len - query_len
    tokens, and for cross attention the decodes' encoder tokens) and `fill` everywhere else."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size
    dev, dtype, cache_dtype = spec.device, spec.dtype, spec.cache_dtype

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    blocks = [-(-s // bs) for s in seq_lens]
    enc_blocks = [-(-n // bs) for n in encoder_seq_lens] if encoder_seq_lens else []
    tables = allocate_blocks(blocks + enc_blocks, spec.num_blocks, g, top=top_blocks)
    block_tables, cross_tables = tables[: len(seq_lens)], tables[len(seq_lens) :] or None
    cache = torch.full((2, spec.num_blocks, bs, hkv, d), fill, dtype=torch.float32)
    cache = cache.to(cache_dtype)
    k_hist = [rnd(s, hkv, d) for s in seq_lens]
    v_hist = [rnd(s, hkv, d) for s in seq_lens]

    def store(table: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        # one indexed write per half, not one per token: 32k-token batches stay fast
        pos = torch.arange(k.shape[0])
        blk, off = torch.tensor(table, dtype=torch.int64)[pos // bs], pos % bs
        cache[0, blk, off] = stored(k, cache_dtype, k_scale)
        cache[1, blk, off] = stored(v, cache_dtype, v_scale)

    for table, s, q, k, v in zip(block_tables, seq_lens, query_lens, k_hist, v_hist, strict=True):
        store(table, k[: s - q], v[: s - q])
    enc_k = enc_v = enc_q = None
    if encoder_seq_lens:
        enc_k = [rnd(n, hkv, d) for n in encoder_seq_lens]
        enc_v = [rnd(n, hkv, d) for n in encoder_seq_lens]
        enc_q = [rnd(n, hq, d) for n in encoder_seq_lens]
        for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
            if q == 1 and s > 1:  # decodes found their encoder K/V cached by an earlier step
                store(cross_tables[i], enc_k[i], enc_v[i])
    query = rnd(sum(query_lens), hq * d)
    key = torch.cat([k[s - q :] for k, s, q in zip(k_hist, seq_lens, query_lens, strict=True)]).flatten(1)
    value = torch.cat([v[s - q :] for v, s, q in zip(v_hist, seq_lens, query_lens, strict=True)]).flatten(1)
    return Batch(
        spec=spec, seq_lens=list(seq_lens), query_lens=list(query_lens), block_tables=block_tables,
        query=query.to(dev), key=key.to(dev), value=value.to(dev), kv_cache=cache.to(dev),
        k_hist=k_hist, v_hist=v_hist, encoder_seq_lens=encoder_seq_lens,
        cross_block_tables=cross_tables, enc_k=enc_k, enc_v=enc_v, enc_q=enc_q,
    )


def reference_forward(
    batch: Batch,
    attn_type: ca.AttentionType = ca.AttentionType.DECODER,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    alibi: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The whole batch through `reference_attention`: [num_query_tokens, Hq * D] float64.

    DECODER attends causally over the request's history; ENCODER_ONLY bidirectionally over its
    tokens; ENCODER bidirectionally over its encoder tokens (query = encoder tokens);
    ENCODER_DECODER from its tokens to its encoder tokens.
    """
    spec = batch.spec
    scale = spec.softmax_scale if scale is None else scale
    hq, d = spec.num_heads, spec.head_size
    cache_dtype = spec.cache_dtype
    query = batch.encoder_query() if attn_type == ca.AttentionType.ENCODER else batch.query
    q_all = query.cpu().view(-1, hq, d)
    outs, at = [], 0
    opts = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi=alibi)
    kinds = ca.AttentionType
    for i, (s, q) in enumerate(zip(batch.seq_lens, batch.query_lens, strict=True)):
        if attn_type == kinds.ENCODER:
            n = batch.encoder_seq_lens[i]
            qi, k, v = q_all[at : at + n], batch.enc_k[i], batch.enc_v[i]
            outs.append(reference_attention(qi, k, v, torch.arange(n), causal=False, **opts))
            at += n
            continue
        qi = q_all[at : at + q]
        at += q
        if attn_type == kinds.ENCODER_DECODER:
            k = round_trip(batch.enc_k[i], cache_dtype, k_scale)
            v = round_trip(batch.enc_v[i], cache_dtype, v_scale)
            outs.append(reference_attention(qi, k, v, torch.zeros(q), causal=False, **opts))
        elif attn_type == kinds.ENCODER_ONLY:
            k, v = batch.k_hist[i], batch.v_hist[i]
            outs.append(reference_attention(qi, k, v, torch.arange(q), causal=False, **opts))
        else:
            k = round_trip(batch.k_hist[i], cache_dtype, k_scale)
            v = round_trip(batch.v_hist[i], cache_dtype, v_scale)
            outs.append(reference_attention(qi, k, v, torch.arange(s - q, s), causal=True, **opts))
    return torch.cat(outs).flatten(1)


def captured(step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """`step` warmed up once on a side stream (compiles and lazy initialisation happen outside the
    capture, as torch.cuda.graph requires), then captured: (the graph, what the captured call
    returned, whose memory each replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def sparse_flex(query, key, value, block_mask, scale, enable_gqa, return_lse, kernel_options):
    """FlexAttention's decode as its CUDA kernel computes it, in float64 over the listed KV blocks
    only (eager flex applies mask_mod densely over every key): query [n, H, 1, D], key / value
    [1, Hkv, N, D], a block mask without mask_mod. Returns the output and the natural-log lse
    (-inf, output 0, for a row with no block). What CPU tests of `ops/flex_decode.attend` run."""
    assert enable_gqa and return_lse and block_mask.mask_mod.__name__ == "noop_mask"
    n, heads, _, head_size = query.shape
    page = block_mask.BLOCK_SIZE[1]
    out = torch.zeros(n, heads, 1, head_size, dtype=torch.float64)
    lse = torch.full((n, heads, 1), -torch.inf, dtype=torch.float64)
    for i in range(n):
        pages = block_mask.kv_indices[i, 0, 0, : int(block_mask.kv_num_blocks[i, 0, 0])].long().cpu()
        if not len(pages):
            continue
        keys = (pages[:, None] * page + torch.arange(page)).flatten()
        k, v = (x[0][:, keys].double().cpu().repeat_interleave(heads // x.shape[1], 0) for x in (key, value))
        scores = torch.einsum("hd,hkd->hk", query[i, :, 0].double().cpu(), k) * scale
        lse[i, :, 0] = scores.logsumexp(-1)
        out[i, :, 0] = torch.einsum("hk,hkd->hd", scores.softmax(-1), v)
    return out.to(query.dtype).to(query.device), lse.float().to(query.device)


def flex_on_cpu(monkeypatch) -> None:
    """Runs `ops/flex_decode.attend` uncompiled over `sparse_flex` (FlexAttention's paged decode
    is CUDA only: `backends.torch_sdpa.FLEX_DEVICES`), so CPU tests cover the mask, the last
    page's attention and the merge."""
    from compiled_attn.ops import flex_decode

    monkeypatch.setattr(flex_decode, "flex_attention", sparse_flex)
    monkeypatch.setattr(flex_decode, "compiled_attend", lambda: flex_decode.attend)


class InputRecorder:
    """A Dynamo backend that keeps the dtype and device of every graph input it is handed."""

    def __init__(self) -> None:
        self.graphs: list[list[tuple[torch.dtype, str]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs.append([(t.dtype, t.device.type) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward


def record_compiles(monkeypatch) -> InputRecorder:
    """An InputRecorder that every `torch.compile` of the test compiles with instead of its own
    backend (fullgraph and dynamic kept; options such as Inductor's dropped with Inductor)."""
    recorder = InputRecorder()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, fullgraph=kw["fullgraph"],
                                                                        dynamic=kw["dynamic"], backend=recorder))
    return recorder


def run_python(script: str, *args: str, env: dict[str, str] | None = None, timeout: int) -> str:
    """`script` (with `args`) in a fresh Python that can import the tests folder and the project,
    with `env` added to this process's environment; fails the test with its stderr unless it
    exits 0, else returns its stdout."""
    tests = Path(__file__).parent
    path = [str(tests), str(tests.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    done = subprocess.run([sys.executable, "-c", script, *args], env={**os.environ, **(env or {}),
                          "PYTHONPATH": os.pathsep.join(path)}, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout

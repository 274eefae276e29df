"""Our split-KV Triton paged decode (ops/triton_decode.py) against the float64 reference, on CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from reference import reference_attention, rel_err

BF16_TOL = 1e-2
# (num_heads, num_kv_heads, head_size, page, dtype): GQA groups 1 / 4 / 8 / 3, pages 16 and 32
SHAPES = [(8, 8, 64, 16, torch.float16), (32, 8, 128, 16, torch.bfloat16), (8, 1, 128, 32, torch.bfloat16),
          (12, 4, 64, 16, torch.float16)]
# (splits, tile, warps, stages): the direct path, splits that leave programs empty, other tiles
CONFIGS = [(1, 64, 4, 2), (3, 32, 4, 3), (8, 64, 8, 3), (32, 128, 4, 2)]


def _decode_module():
    if not torch.cuda.is_available():
        pytest.skip("the Triton decode runs on CUDA")
    from compiled_attn.ops import triton_decode

    return triton_decode


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}p{s[3]}")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"s{c[0]}n{c[1]}w{c[2]}st{c[3]}")
def test_decode_matches_the_float64_reference(shape, config):
    """Random lengths (1, a page's edge, long ones), shuffled pages, a query sliced from a fused
    QKV projection, and table entries past each request's pages that would fault if read."""
    td = _decode_module()
    num_heads, num_kv_heads, head_size, page, dtype = shape
    rng = random.Random(hash((shape, config)) % 1000)
    lens = [1, page, page + 1, rng.randint(2, 700), rng.randint(700, 1500), 3 * page - 1]
    batch, width = len(lens), 1600 // page
    num_blocks = sum(-(-n // page) for n in lens) + 1
    kv = torch.randn(2, num_blocks, page, num_kv_heads, head_size, dtype=dtype, device="cuda")
    blocks = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.full((batch, width), 2**30, dtype=torch.int32)  # never read: a read faults
    at = 0
    for i, n in enumerate(lens):
        pages = -(-n // page)
        tables[i, :pages] = torch.tensor(blocks[at : at + pages])
        at += pages
    fused = torch.randn(batch, num_heads + 2 * num_kv_heads, head_size, dtype=dtype, device="cuda")
    q = fused[:, :num_heads]
    out = torch.full_like(q, float("nan"))
    splits, block_n, warps, stages = config
    cfg = td.DecodeConfig(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
    decode = td.PagedDecode(batch, num_heads, head_size, cfg, "cuda")
    scale = head_size**-0.5
    decode.run(q, kv[0], kv[1], tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda"), out, scale)
    for i, n in enumerate(lens):
        pages = tables[i, : -(-n // page)].long().cuda()
        keys, values = (kv[h][pages].flatten(0, 1)[:n] for h in (0, 1))
        ref = reference_attention(q[i : i + 1].cpu(), keys.cpu(), values.cpu(), torch.tensor([n - 1]), causal=True,
                                  scale=scale)
        assert rel_err(out[i : i + 1], ref) <= BF16_TOL, (i, n)


@pytest.mark.gpu
def test_a_replayed_graph_follows_the_lengths_and_tables_it_reads():
    """Captured once, replayed over new lengths and pages written into the same buffers: each
    replay equals the reference for what is live then, longer and shorter than at capture."""
    td = _decode_module()
    num_heads, num_kv_heads, head_size, page, batch = 32, 8, 128, 16, 4
    kv = torch.randn(2, 400, page, num_kv_heads, head_size, dtype=torch.bfloat16, device="cuda")
    lens = torch.ones(batch, dtype=torch.int32, device="cuda")
    tables = torch.zeros(batch, 64, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_heads, head_size, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    decode = td.PagedDecode(batch, num_heads, head_size, td.default_config(batch, num_kv_heads, q.device), "cuda")
    run = lambda: decode.run(q, kv[0], kv[1], tables, lens, out, head_size**-0.5)  # noqa: E731
    run()  # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    rng = random.Random(3)
    for _ in range(4):
        new = [rng.randint(1, 1024) for _ in range(batch)]
        lens.copy_(torch.tensor(new))
        tables.copy_(torch.randint(0, 400, tables.shape))
        q.normal_()
        graph.replay()
        for i, n in enumerate(new):
            pages = tables[i, : -(-n // page)].long()
            keys, values = (kv[h][pages].flatten(0, 1)[:n] for h in (0, 1))
            ref = reference_attention(q[i : i + 1].cpu(), keys.cpu(), values.cpu(), torch.tensor([n - 1]), causal=True,
                                      scale=head_size**-0.5)
            assert rel_err(out[i : i + 1], ref) <= BF16_TOL, (i, n)

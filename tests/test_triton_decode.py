"""Our split-KV Triton paged decode (ops/triton_decode.py) against the float64 reference: on CUDA,
and on the CPU through Triton's interpreter (fp16 / fp32: the interpreter has no bf16)."""

from __future__ import annotations

import importlib.util
import random
import types
from pathlib import Path

import pytest
import torch
from reference import reference_attention, rel_err, run_python

import compiled_attn as ca

BF16_TOL = 1e-2
# (num_heads, num_kv_heads, head_size, page, dtype): GQA groups 1 / 4 / 8 / 3, pages 16 and 32
SHAPES = [(8, 8, 64, 16, torch.float16), (32, 8, 128, 16, torch.bfloat16), (8, 1, 128, 32, torch.bfloat16),
          (12, 4, 64, 16, torch.float16)]
# (splits, tile, warps, stages): the direct path, splits that leave programs empty, other tiles
CONFIGS = [(1, 64, 4, 2), (3, 32, 4, 3), (8, 64, 8, 3), (32, 128, 4, 2), (8, 128, 8, 3)]


def _decode_module():
    if not torch.cuda.is_available():
        pytest.skip("the Triton decode runs on CUDA")
    from compiled_attn.ops import triton_decode

    return triton_decode


def shuffled_tables(lens: list[int], page: int, width: int) -> tuple[torch.Tensor, int]:
    """(int32 block tables [len(lens), width], the block count a cache needs for them): each
    request's pages are distinct shuffled blocks from 1 up, and the entries past them 2**30, never
    read (a read would fault)."""
    need = [-(-n // page) for n in lens]
    num_blocks = sum(need) + 1
    blocks = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = torch.full((len(lens), width), 2**30, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(blocks[at : at + n])
        at += n
    return tables, num_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}p{s[3]}")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"s{c[0]}n{c[1]}w{c[2]}st{c[3]}")
def test_decode_matches_the_float64_reference(shape, config):
    """Random lengths (1, a page's edge, long ones), shuffled pages, a query sliced from a fused
    QKV projection, and table entries past each request's pages that would fault if read."""
    td = _decode_module()
    num_heads, num_kv_heads, head_size, page, dtype = shape
    seed = SHAPES.index(shape) * len(CONFIGS) + CONFIGS.index(config)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    lens = [1, page, page + 1, rng.randint(2, 700), rng.randint(700, 1500), 3 * page - 1]
    batch = len(lens)
    tables, num_blocks = shuffled_tables(lens, page, 1600 // page)
    kv = torch.randn(2, num_blocks, page, num_kv_heads, head_size, dtype=dtype, device="cuda")
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
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("fp16_mma", [False, True], ids=["widened", "fp16-mma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_size", [32, 128])
def test_fp8_caches_match_the_float64_reference(cache_dtype, fp16_mma, dtype, head_size):
    """fp8 caches storing K / k_scale and V / v_scale, bf16 or fp16 queries, split and direct: each way of
    widening against the reference on the scaled-back cache. One request's query reaches 3e4,
    past fp16's 2^14 headroom, and one stays near 1e-6: fp16_mma's power-of-two scaling of each
    query row is exercised both ways. Head size 32 is fp16_mma's smallest (halves of 16)."""
    td = _decode_module()
    torch.manual_seed(5)
    num_heads, num_kv_heads, page = 32, 8, 16
    lens = [1, page + 1, 300, 1100]
    batch = len(lens)
    tables, num_blocks = shuffled_tables(lens, page, 1200 // page)
    k_scale, v_scale = 0.5, 3.0
    kv = torch.randn(2, num_blocks, page, num_kv_heads, head_size, device="cuda")
    kv = torch.stack([kv[0] / k_scale, kv[1] / v_scale]).to(cache_dtype)
    stored = kv.double().cpu()  # what the cache holds, exactly
    q = torch.randn(batch, num_heads, head_size, device="cuda")
    q[1] *= 3e4 if dtype == torch.bfloat16 else 1e4  # past 2^14, inside fp16's range
    q[2] *= 1e-6  # and one far below 1: scaled up, not into fp16's subnormals
    q = q.to(dtype)
    for splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        cfg = td.DecodeConfig(num_splits=splits, block_n=64, num_stages=3, fp16_mma=fp16_mma)
        td.PagedDecode(batch, num_heads, head_size, cfg, "cuda").run(
            q, kv[0], kv[1], tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda"), out, head_size**-0.5,
            k_scale, v_scale)
        for i, n in enumerate(lens):
            pages = tables[i, : -(-n // page)].long()
            keys, values = (stored[h][pages].flatten(0, 1)[:n] * sc for h, sc in ((0, k_scale), (1, v_scale)))
            ref = reference_attention(q[i : i + 1].cpu(), keys, values, torch.tensor([n - 1]), causal=True,
                                      scale=head_size**-0.5)
            assert rel_err(out[i : i + 1], ref) <= BF16_TOL, (splits, i, n)


def test_fp16_mma_widens_fp8_pairs_in_registers():
    """What `fp16_mma` is for, pinned in the PTX for sm90 (compiled on the CPU with Triton's own
    ptxas, `scripts/triton_decode_ptx.py`): no 8-bit reads of the tile from shared memory, no
    bf16 repacking, and one `cvt.rn.f16x2` per pair: 64 a thread for a 64 x 128 K and V tile
    over 128 threads. (Triton's own widening had both on 3.9; that is Triton's to change.) The
    tile is copied to shared memory 16 bytes at a time and read back only by ldmatrix, in the
    MMA operands' layout: no 2-byte shared reads, as when the whole tile was widened first and
    moved through shared memory again as fp16 (32 `ld.shared.b16` and 16 8-byte copies here). In
    the SASS (`--sass`): the loop reads shared memory mostly by ldmatrix (12 scalar loads against
    20 ldmatrix; the old kernel 56 against 20), and the fp16 tile no longer held in registers
    leaves room for 5 or more programs an SM (the old kernel's 137 registers: 3)."""
    pytest.importorskip("triton")
    path = Path(__file__).parent.parent / "scripts" / "triton_decode_ptx.py"
    spec = importlib.util.spec_from_file_location("triton_decode_ptx", path)
    ptx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ptx)
    for cache in ("e4m3", "e5m2"):
        pairs = ptx.row(ptx.compile_shape(cache, True, 64, 4, 3, group=4))
        assert pairs["ld.shared 8-bit"] == 0 and pairs["cvt.bf16.f16"] == 0, (cache, pairs)
        assert pairs["fp8 cvt"] == 64, (cache, pairs)
        assert pairs["ld.shared.b16"] == 0 and pairs["cp.async 8B"] == 0, (cache, pairs)
    sass = ptx.sass_row(ptx.compile_shape("e4m3", True, 64, 4, 3, group=4), warps=4)
    assert sass["loop LDS"] < sass["loop LDSM"] and sass["programs / SM"] >= 5, sass


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_default_config_fills_the_card_and_reads_fp8_pairs_where_it_can(capability, monkeypatch):
    """Two programs per SM over (request, KV head) pairs, at most 32 splits, 128-token tiles
    between 3 and 31 splits; fp8 caches through fp16_mma on sm89 and later, never 16-bit ones."""
    pytest.importorskip("triton")
    from compiled_attn.ops import triton_decode as td

    card = types.SimpleNamespace(multi_processor_count=132, major=capability[0], minor=capability[1])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: card)
    fp16_mma = capability >= (8, 9)
    for batch, splits, block_n in ((1, 32, 64), (4, 9, 128), (16, 3, 128), (32, 2, 64), (64, 1, 64), (256, 1, 64)):
        for fp8_cache in (False, True):
            want = td.DecodeConfig(num_splits=splits, block_n=block_n, num_stages=3, fp16_mma=fp8_cache and fp16_mma)
            assert td.default_config(batch, 8, "cuda", fp8_cache=fp8_cache) == want, (batch, fp8_cache)


@pytest.mark.gpu
def test_a_replayed_graph_follows_the_lengths_and_tables_it_reads():
    """Captured once, replayed over new lengths and pages written into the same buffers: each
    replay equals the reference for what is live then, longer and shorter than at capture."""
    td = _decode_module()
    torch.manual_seed(2)
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


def interpreter_cases() -> None:
    """Run by `test_interpreter_matches_the_float64_reference` in a process with TRITON_INTERPRET=1
    (Triton reads it when the kernels are defined): small shapes, each path of the kernels."""
    from compiled_attn.ops import triton_decode as td

    torch.manual_seed(0)
    # (heads, kv heads, head size, page, dtype, splits, tile, cache dtype): group 4 / 3 / 1, pages
    # of 8 and 32, the direct path, splits left empty, a tile smaller and larger than a page, fp8
    # caches (scales that are not each other's inverse)
    cases = [(8, 2, 32, 16, torch.float16, 1, 32, None), (12, 4, 32, 8, torch.float32, 3, 16, None),
             (4, 4, 16, 32, torch.float16, 8, 16, None), (8, 2, 32, 16, torch.float16, 3, 64, torch.float8_e4m3fn),
             (8, 2, 32, 16, torch.float16, 1, 64, torch.float8_e5m2)]
    for num_heads, num_kv_heads, head_size, page, dtype, splits, block_n, cache_dtype in cases:
        lens = [1, page, page + 1, 3 * page - 1, 97, 0]  # 0: no live token, zeros
        batch = len(lens)
        tables, num_blocks = shuffled_tables(lens, page, 128 // page)
        k_scale, v_scale = (0.5, 3.0) if cache_dtype else (1.0, 1.0)
        kv = torch.randn(2, num_blocks, page, num_kv_heads, head_size)
        kv = torch.stack([kv[0] / k_scale, kv[1] / v_scale]).to(cache_dtype or dtype)  # what the cache stores
        q = torch.randn(batch, num_heads + 2 * num_kv_heads, head_size).to(dtype)[:, :num_heads]  # a fused QKV slice
        out = torch.full_like(q, float("nan"))
        decode = td.PagedDecode(batch, num_heads, head_size, td.DecodeConfig(splits, block_n), "cpu")
        decode.run(q, kv[0], kv[1], tables, torch.tensor(lens, dtype=torch.int32), out, head_size**-0.5,
                   k_scale, v_scale)
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        for i, n in enumerate(lens[:-1]):
            pages = tables[i, : -(-n // page)].long()
            keys, values = (kv[h][pages].flatten(0, 1)[:n].double() * sc for h, sc in ((0, k_scale), (1, v_scale)))
            ref = reference_attention(q[i : i + 1], keys, values, torch.tensor([n - 1]), causal=True,
                                      scale=head_size**-0.5)
            err = rel_err(out[i : i + 1], ref)
            assert err <= (2e-3 if dtype == torch.float16 else 1e-5), (num_heads, num_kv_heads, splits, i, n, err)


def interpreter_state_case() -> None:
    """A FLASHINFER State's Triton graph decode end to end on the CPU (Triton's interpreter, no
    FlashInfer: its wrappers are never made on this path): the State's own lengths and block-table
    buffers as each step's upload wrote them, the op's call, an fp8 layer's scales."""
    from compiled_attn.backends import flashinfer as fib
    from compiled_attn.ops import triton_decode as td

    td.default_config = lambda batch, kv_heads, device, fp8_cache: td.DecodeConfig(num_splits=3, block_n=16)  # no CUDA
    fib.graph_decode_kernel = lambda spec: "triton"
    torch.manual_seed(1)
    for kv_cache_dtype, scales in (("auto", (1.0, 1.0)), ("fp8_e4m3", (0.5, 3.0))):
        spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, num_blocks=24,
                                dtype=torch.float16, device="cpu", max_seq_len_to_capture=96,
                                kv_cache_dtype=kv_cache_dtype)
        state = fib.FlashInferBackend.get_state_cls()(spec)
        with state.graph_capture(4):
            md_bs = state.graph_capture_get_metadata_for_batch(4)
            bufs = state.get_graph_input_buffers(md_bs)
            graph_state = state.graph_clone(4)
        impl = fib.FlashInferBackend.get_impl_cls()(8, 64, spec.softmax_scale, num_kv_heads=2,
                                                    kv_cache_dtype=kv_cache_dtype)
        name, _keep = impl.register(*scales, ca.AttentionType.DECODER)
        builder = fib.FlashInferBackend.get_builder_cls()(spec)
        cache = torch.randn(2, 24, 16, 2, 64).to(spec.cache_dtype)
        for seq_lens, tables in (([17, 3], [[5, 6], [7]]), ([40, 9, 96], [[9, 2, 4], [1], [3, 8, 10, 11, 12, 13]])):
            md = builder.build(seq_lens, [1] * len(seq_lens), tables)
            graph_state.prepare_graph_input_buffers(bufs, md)
            graph_state.begin_forward(md)
            q = torch.randn(4, 8, 64, dtype=torch.float16)
            out = torch.full_like(q, float("nan"))
            with ca.set_forward_context(md_bs):
                fib.FlashInferBackend.attention_op(q, None, None, cache, out, name)
            for i, (n, table) in enumerate(zip(seq_lens, tables, strict=True)):
                keys, values = (cache[h][table].flatten(0, 1)[:n].double() * scales[h] for h in (0, 1))
                ref = reference_attention(q[i : i + 1], keys, values, torch.tensor([n - 1]), causal=True,
                                          scale=spec.softmax_scale)
                assert rel_err(out[i : i + 1], ref) <= 2e-3, (kv_cache_dtype, i, n)


def run_under_interpreter(script: str, timeout: int) -> None:
    """`script` in a fresh Python with TRITON_INTERPRET=1 (the flag is read when triton is first
    imported) and the tests folder importable; fails the test with its stderr unless it exits 0."""
    pytest.importorskip("triton")
    run_python(script, env={"TRITON_INTERPRET": "1"}, timeout=timeout)


def test_interpreter_matches_the_float64_reference():
    """The kernels' indexing, masks, splits and merge, run by Triton's interpreter on the CPU,
    alone and behind a FLASHINFER State's graph decode."""
    run_under_interpreter("import test_triton_decode as t; t.interpreter_cases(); t.interpreter_state_case()", 600)


def test_what_the_kernels_addressing_assumes_is_refused_before_a_launch():
    """A head size the kernel cannot tile, more rows than the split buffers hold, caches of
    different layouts, heads not a multiple of the KV heads, a strided head dimension, a cache
    of integers or of two fp8 formats, fp16_mma at a head size its halves cannot tile, over an
    odd fp8 layout or off sm89+: each a ValueError naming it, before anything is launched (these
    run on the CPU)."""
    td = pytest.importorskip("compiled_attn.ops.triton_decode")
    cfg = td.DecodeConfig(num_splits=2)
    with pytest.raises(ValueError, match="power-of-two head size >= 16, not 48"):
        td.PagedDecode(2, 8, 48, cfg, "cpu")
    decode = td.PagedDecode(2, 8, 32, cfg, "cpu")
    kv = torch.randn(2, 4, 16, 2, 32)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    q = torch.randn(3, 8, 32)
    cases = [
        (dict(q=q, out=torch.empty_like(q)), "up to 2 rows of 8 heads x 32"),
        (dict(k=kv[0][:, :, :1]), "views of one layout"),
        (dict(q=torch.randn(2, 6, 32), out=torch.empty(2, 6, 32)), "up to 2 rows of 8 heads"),
        (dict(k=torch.randn(4, 16, 3, 32), v=torch.randn(4, 16, 3, 32)), "not a multiple of 3 KV heads"),
        (dict(q=torch.randn(2, 32, 8).transpose(1, 2)), "contiguous head dimension"),
        (dict(k=kv[0].to(torch.uint8), v=kv[1].to(torch.uint8)), "the queries' dtype or one fp8 format"),
        (dict(k=kv[0].to(torch.float8_e4m3fn), v=kv[1].to(torch.float8_e5m2)), "one fp8 format"),
    ]
    for over, message in cases:
        args = {**dict(q=q[:2], k=kv[0], v=kv[1], out=torch.empty(2, 8, 32)), **over}
        with pytest.raises(ValueError, match=message):
            decode.run(args["q"], args["k"], args["v"], tables, lens, args["out"], 0.1)
    with pytest.raises(ValueError, match="head sizes >= 32, not 16"):
        td.PagedDecode(2, 8, 16, td.DecodeConfig(num_splits=2, fp16_mma=True), "cpu")
    td.PagedDecode(2, 8, 16, cfg, "cpu")  # without fp16_mma, 16 stays served
    # fp16_mma reads fp8 byte pairs, with sm89's cvt: an odd start, and a device without it
    pairs = td.PagedDecode(2, 8, 32, td.DecodeConfig(num_splits=2, fp16_mma=True), "cpu")
    fp8 = kv.to(torch.float8_e4m3fn)
    flat = fp8.new_zeros(fp8.numel() + 1)  # the caches one byte in: an odd start
    odd = flat[1:].view(fp8.shape)
    for k, v, message in ((odd[0], odd[1], "strides and start must be even"),
                          (fp8[0], fp8[1], "compute capability >= 8.9, not cpu")):
        with pytest.raises(ValueError, match=message):
            pairs.run(q[:2], k, v, tables, lens, torch.empty(2, 8, 32), 0.1)


@pytest.mark.gpu
def test_a_first_launch_inside_a_capture_raises():
    """Triton compiles at a kernel's first launch: that must happen before capture."""
    td = _decode_module()
    kv = torch.randn(2, 4, 16, 2, 64, dtype=torch.float16, device="cuda")
    tables = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    lens = torch.ones(2, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 8, 64, dtype=torch.float16, device="cuda")
    decode = td.PagedDecode(2, 8, 64, td.DecodeConfig(num_splits=2), "cuda")
    with pytest.raises(RuntimeError, match="run it once before capturing"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        decode.run(q, kv[0], kv[1], tables, lens, torch.empty_like(q), 0.125)

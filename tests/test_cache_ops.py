"""Cache ops: kv_cache_update writes exactly the metadata's slots; copy_blocks / swap_blocks copy
exactly the named blocks. Caches start NaN-filled and are compared bit for bit, so a stray write
of any value (even another NaN pattern) shows."""

from __future__ import annotations

import pytest
import torch
from test_triton_decode import run_under_interpreter

import compiled_attn as ca
from compiled_attn.backends import flashinfer as fib
from compiled_attn.registry import BACKEND_CLASSES

BACKEND = ca.get_attn_backend("TORCH_SDPA")
FLASHINFER = BACKEND_CLASSES()["FLASHINFER"]
HKV, D, BS, NB = 2, 8, 4, 16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a.cpu()), bits(b.cpu()))


def make_spec(kv_cache_dtype: str = "auto", device: str = "cpu", **kw) -> ca.AttentionSpec:
    return ca.AttentionSpec(num_heads=4, num_kv_heads=HKV, head_size=D, block_size=BS, num_blocks=NB,
                            dtype=torch.float32, device=device, kv_cache_dtype=kv_cache_dtype, **kw)


def nan_cache(spec: ca.AttentionSpec, num_blocks: int = NB, device: str = "cpu") -> torch.Tensor:
    shape = BACKEND.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return torch.full(shape, float("nan")).to(spec.cache_dtype).to(device)


def random_cache(num_blocks: int = NB, seed: int = 0, dtype=torch.float32, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, BS, HKV, D, generator=g).to(dtype).to(device)


def new_kv(num_tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, HKV, D, generator=g), torch.randn(num_tokens, HKV, D, generator=g) * 3


def flat(cache: torch.Tensor, half: int) -> torch.Tensor:
    """One half of the cache as [num_blocks * block_size, num_kv_heads, head_size] rows, by slot."""
    return cache[half].reshape(-1, *cache.shape[3:])


def write(md, key, value, cache, cross=False, k_scale=1.0, v_scale=1.0, backend=BACKEND) -> None:
    """Run the cache-write op as a (cross-)attention layer of the metadata's spec with these scales
    would (the query it also takes is read for its rows only)."""
    spec = md.spec
    impl = backend.get_impl_cls()(spec.num_heads, spec.head_size, spec.softmax_scale, spec.num_kv_heads,
                                  kv_cache_dtype=spec.kv_cache_dtype)
    attn_type = ca.AttentionType.ENCODER_DECODER if cross else ca.AttentionType.DECODER
    layer_name, _call = impl.register(k_scale, v_scale, attn_type)  # _call keeps the name alive
    query = torch.zeros(md.num_prefill_tokens + md.num_decode_tokens, spec.num_heads, spec.head_size,
                        dtype=key.dtype, device=key.device)
    with ca.set_forward_context(md):
        torch.ops.compiled_attn.kv_cache_update(query, key, value, cache, layer_name)


def check_written(cache, before, slots, key, value) -> None:
    """Rows `slots` hold key/value (cast to the cache dtype); every other slot kept its bits."""
    slots = torch.as_tensor(slots, dtype=torch.int64)
    for half, x in ((0, key), (1, value)):
        assert same_bits(flat(cache, half)[slots], x.to(cache.dtype))
        others = torch.ones(NB * BS, dtype=torch.bool)
        others[slots] = False
        assert same_bits(flat(cache, half)[others], flat(before, half)[others])


def test_update_writes_exactly_the_slots():
    spec = make_spec()
    md = BACKEND.get_builder_cls()(spec).build([7, 9, 6], [7, 2, 1], [[3, 0], [5, 11, 2], [15, 8]])
    key, value = new_kv(10)
    cache = nan_cache(spec)
    before = cache.clone()
    write(md, key, value, cache)
    # request 0: block 3 then 0; request 1: positions 7, 8 -> block 11 slot 3, block 2 slot 0; request 2: pos 5
    expected = [12, 13, 14, 15, 0, 1, 2, 47, 8, 33]
    assert md.slot_mapping.tolist() == expected
    check_written(cache, before, expected, key, value)


def test_update_skips_pad_slots():
    spec = make_spec()
    md = BACKEND.get_builder_cls()(spec).build([5, 3], [5, 1], [[6, 9], [4]])
    slots = md.slot_mapping.tolist()
    md.slot_mapping[[1, 4, 5]] = -1  # pads: rows 1, 4 (request 0) and 5 (the decode) write nothing
    key, value = new_kv(6)
    cache = nan_cache(spec)
    before = cache.clone()
    write(md, key, value, cache)
    kept = [0, 2, 3]
    check_written(cache, before, [slots[i] for i in kept], key[kept], value[kept])


def test_update_all_pads_writes_nothing():
    spec = make_spec()
    md = BACKEND.get_builder_cls()(spec).build([1, 1], [1, 1], [[0], [1]])
    md.slot_mapping.fill_(-1)
    cache = random_cache()
    before = cache.clone()
    write(md, *new_kv(2), cache)
    assert same_bits(cache, before)


def test_update_cross_writes_the_prefills_encoder_tokens():
    spec = make_spec(attn_type=ca.AttentionType.ENCODER_DECODER)
    md = BACKEND.get_builder_cls()(spec).build(
        [2, 7], [2, 1], [[0], [1, 2]], encoder_seq_lens=[6, 3], cross_block_tables=[[9, 4], [13]]
    )
    key, value = new_kv(6)  # only the prefill's encoder tokens: the decode's are cached already
    cache = nan_cache(spec)
    before = cache.clone()
    write(md, key, value, cache, cross=True)
    expected = [36, 37, 38, 39, 16, 17]
    assert md.cross_slot_mapping.tolist() == expected
    check_written(cache, before, expected, key, value)


def fp8_spec(kv_cache_dtype: str, device: str = "cpu") -> ca.AttentionSpec:
    # fp8 caches are FLASHINFER's (its builder and layers run on CPU too): its head sizes and dtypes
    return ca.AttentionSpec(num_heads=4, num_kv_heads=HKV, head_size=64, block_size=BS, num_blocks=NB,
                            dtype=torch.bfloat16, device=device, kv_cache_dtype=kv_cache_dtype)


def fp8_kv(num_tokens: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return tuple((torch.randn(num_tokens, HKV, 64, generator=g) * s).bfloat16().to(device) for s in (1, 3))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "fp8"])
def test_update_fp8_stores_scaled_values(kv_cache_dtype):
    spec = fp8_spec(kv_cache_dtype)
    md = FLASHINFER.get_builder_cls()(spec).build([6], [6], [[7, 2]])
    key, value = fp8_kv(6)
    cache = nan_cache(spec)
    assert cache.dtype == ca.kv_cache_torch_dtype(kv_cache_dtype, torch.bfloat16)
    before = cache.clone()
    k_scale, v_scale = 0.37, 2.5
    write(md, key, value, cache, k_scale=k_scale, v_scale=v_scale, backend=FLASHINFER)
    check_written(cache, before, md.slot_mapping.tolist(), key.float() / k_scale, value.float() / v_scale)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_update_fp8_saturates_values_past_the_format(kv_cache_dtype):
    """Values that pass the fp8 format's largest finite value once scaled (key / 0.5, value / 3)
    are stored as that value, of their sign, never inf (e5m2's cast alone gives inf, e4m3fn's
    saturates); in-range values as scaled; NaN as NaN, over finite old contents."""
    spec = fp8_spec(kv_cache_dtype)
    md = FLASHINFER.get_builder_cls()(spec).build([4], [4], [[7]])
    cache_dtype = ca.kv_cache_torch_dtype(kv_cache_dtype, torch.bfloat16)
    most = torch.finfo(cache_dtype).max
    # each key past the range only after its scale: most * 0.75 / 0.5 = 1.5 * most
    key = torch.tensor([most * 0.75, -most * 0.75, float("inf"), 1.5]).view(4, 1, 1).expand(4, HKV, 64).bfloat16()
    value = torch.tensor([float("nan"), most * 0.5, -6.0, -most * 0.4]).view(4, 1, 1).expand(4, HKV, 64).bfloat16()
    cache = torch.zeros(ca.registry.BACKEND_CLASSES()["FLASHINFER"].get_kv_cache_shape(NB, BS, HKV, 64)).to(
        cache_dtype)
    write(md, key, value, cache, k_scale=0.5, v_scale=3.0, backend=FLASHINFER)
    k_rows = cache[0].view(-1, HKV, 64)[md.slot_mapping].float()[:, 0, 0]
    v_rows = cache[1].view(-1, HKV, 64)[md.slot_mapping].float()[:, 0, 0]
    assert k_rows.tolist() == [most, -most, most, 3.0]
    assert v_rows[0].isnan() and v_rows[2].item() == -2.0
    assert v_rows[1].item() == pytest.approx(float(key.new_tensor(most * 0.5).float()) / 3.0, rel=0.15)
    assert v_rows[3].item() == pytest.approx(-float(key.new_tensor(most * 0.4).float()) / 3.0, rel=0.15)


def test_update_bf16_cache_from_bf16_keys():
    spec = ca.AttentionSpec(num_heads=4, num_kv_heads=HKV, head_size=D, block_size=BS, num_blocks=NB,
                            dtype=torch.bfloat16, device="cpu")
    md = BACKEND.get_builder_cls()(spec).build([5], [5], [[1, 10]])
    key, value = (x.bfloat16() for x in new_kv(5))
    cache = nan_cache(spec)
    before = cache.clone()
    write(md, key, value, cache)
    check_written(cache, before, md.slot_mapping.tolist(), key, value)


def test_copy_blocks_copies_named_blocks_in_every_cache():
    caches = [random_cache(seed=1), random_cache(seed=2)]
    before = [c.clone() for c in caches]
    pairs = torch.tensor([[1, 5], [3, 7], [3, 0]])
    BACKEND.copy_blocks(caches, pairs)
    for cache, old in zip(caches, before, strict=True):
        for src, dst in pairs.tolist():
            assert same_bits(cache[:, dst], old[:, src])
        untouched = [b for b in range(NB) if b not in (5, 7, 0)]
        assert same_bits(cache[:, untouched], old[:, untouched])


def test_copy_blocks_reads_sources_before_writing():
    # 1 -> 2 and 2 -> 3 in one call: block 3 gets block 2's old contents, not block 1's.
    cache = random_cache()
    old = cache.clone()
    BACKEND.copy_blocks([cache], torch.tensor([[1, 2], [2, 3]]))
    assert same_bits(cache[:, 2], old[:, 1])
    assert same_bits(cache[:, 3], old[:, 2])


def test_copy_blocks_fp8_cache_bit_exact():
    cache = random_cache(dtype=torch.float8_e4m3fn)
    old = cache.clone()
    BACKEND.copy_blocks([cache], torch.tensor([[4, 9]]))
    assert same_bits(cache[:, 9], old[:, 4])
    assert same_bits(cache[:, :9], old[:, :9]) and same_bits(cache[:, 10:], old[:, 10:])


def test_swap_blocks_cpu_to_cpu_between_caches_of_different_sizes():
    src, dst = random_cache(seed=1), random_cache(num_blocks=6, seed=2)
    src_before, dst_before = src.clone(), dst.clone()
    BACKEND.swap_blocks(src, dst, torch.tensor([[15, 0], [2, 4]]))
    assert same_bits(dst[:, 0], src_before[:, 15])
    assert same_bits(dst[:, 4], src_before[:, 2])
    assert same_bits(dst[:, [1, 2, 3, 5]], dst_before[:, [1, 2, 3, 5]])
    assert same_bits(src, src_before)  # a copy, not an exchange


BAD_PAIRS = {
    "src_out_of_range": torch.tensor([[0, 1], [NB, 2]]),
    "dst_out_of_range": torch.tensor([[0, NB]]),
    "negative": torch.tensor([[-1, 2]]),
    "int32": torch.tensor([[0, 1]], dtype=torch.int32),
    "not_pairs": torch.tensor([0, 1]),
    "three_columns": torch.tensor([[0, 1, 2]]),
}


@pytest.mark.parametrize("name", list(BAD_PAIRS))
def test_copy_blocks_bad_pairs_raise_and_copy_nothing(name):
    caches = [random_cache(seed=1), random_cache(seed=2)]
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match="block"):
        BACKEND.copy_blocks(caches, BAD_PAIRS[name])
    assert all(same_bits(c, b) for c, b in zip(caches, before, strict=True))


@pytest.mark.parametrize("name", list(BAD_PAIRS))
def test_swap_blocks_bad_pairs_raise_and_copy_nothing(name):
    src, dst = random_cache(seed=1), random_cache(seed=2)
    before = dst.clone()
    with pytest.raises(ValueError, match="block"):
        BACKEND.swap_blocks(src, dst, BAD_PAIRS[name])
    assert same_bits(dst, before)


def test_swap_blocks_pair_valid_in_src_but_not_in_dst_raises():
    src, dst = random_cache(), random_cache(num_blocks=4)
    before = dst.clone()
    with pytest.raises(ValueError, match="dst block ids"):
        BACKEND.swap_blocks(src, dst, torch.tensor([[10, 4]]))
    assert same_bits(dst, before)


@pytest.mark.parametrize(
    "dst", [random_cache(dtype=torch.bfloat16), torch.randn(2, NB, BS, HKV, D + 1)], ids=["dtype", "shape"]
)
def test_swap_blocks_mismatched_caches_raise(dst):
    before = dst.clone()
    with pytest.raises(ValueError, match="differ"):
        BACKEND.swap_blocks(random_cache(), dst, torch.tensor([[0, 1]]))
    assert same_bits(dst, before)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["cpu_to_cuda", "cuda_to_cpu"])
def test_swap_blocks_across_devices(direction):
    src_dev, dst_dev = ("cpu", "cuda") if direction == "cpu_to_cuda" else ("cuda", "cpu")
    src, dst = random_cache(seed=1, device=src_dev), random_cache(num_blocks=8, seed=2, device=dst_dev)
    src_before, dst_before = src.cpu(), dst.cpu()
    BACKEND.swap_blocks(src, dst, torch.tensor([[3, 7], [12, 0]]))
    torch.cuda.synchronize()
    assert dst.device.type == dst_dev
    assert same_bits(dst[:, 7], src_before[:, 3])
    assert same_bits(dst[:, 0], src_before[:, 12])
    assert same_bits(dst[:, 1:7], dst_before[:, 1:7])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_update_cuda_matches_cpu_bit_for_bit(kv_cache_dtype, monkeypatch):
    # The Triton write on CUDA stores the same bytes as the CPU index_put, pads included.
    monkeypatch.setattr(fib, "plans_in_build", lambda spec: False)  # a write needs no plan (nor its JIT build)
    fp8 = kv_cache_dtype != "auto"
    backend = FLASHINFER if fp8 else BACKEND  # fp8 caches are FLASHINFER's
    spec_of = fp8_spec if fp8 else make_spec
    spec = spec_of(kv_cache_dtype)
    tables = [[3, 0], [5, 11, 2], [15, 8]]
    md = backend.get_builder_cls()(spec).build([7, 9, 6], [7, 2, 1], tables)
    md.slot_mapping[3] = -1
    key, value = fp8_kv(10) if fp8 else new_kv(10)
    cache = nan_cache(spec)
    write(md, key, value, cache, k_scale=0.5, v_scale=2.0, backend=backend)
    md_cuda = backend.get_builder_cls()(spec_of(kv_cache_dtype, "cuda")).build([7, 9, 6], [7, 2, 1], tables)
    md_cuda.slot_mapping[3] = -1
    cache_cuda = nan_cache(spec, device="cuda")
    write(md_cuda, key.cuda(), value.cuda(), cache_cuda, k_scale=0.5, v_scale=2.0, backend=backend)
    assert same_bits(cache_cuda.cpu(), cache)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_update_cuda_saturates_fp8_like_cpu(kv_cache_dtype, monkeypatch):
    """Values past the fp8 format's range: the Triton write stores what the CPU write does (the
    largest finite value of their sign), NaN as NaN."""
    monkeypatch.setattr(fib, "plans_in_build", lambda spec: False)  # a write needs no plan (nor its JIT build)
    spec = fp8_spec(kv_cache_dtype)
    tables = [[7]]
    key = torch.tensor([1e6, -1e6, float("inf"), 1.5]).view(4, 1, 1).expand(4, HKV, 64).bfloat16()
    value = torch.tensor([float("nan"), 3e5, -2.0, -7e4]).view(4, 1, 1).expand(4, HKV, 64).bfloat16()
    caches = []
    for device in ("cpu", "cuda"):
        md = FLASHINFER.get_builder_cls()(fp8_spec(kv_cache_dtype, device)).build([4], [4], tables)
        cache = nan_cache(spec, device=device)
        write(md, key.to(device), value.to(device), cache, backend=FLASHINFER)
        caches.append(cache.cpu())
    assert same_bits(caches[1], caches[0])


def placed(t: torch.Tensor, shift: int, device: str = "cuda") -> torch.Tensor:
    """A contiguous copy of `t` on `device`, starting `shift` elements past a 64-byte boundary."""
    base = torch.empty(t.numel() + 64 + shift, dtype=t.dtype, device=device)
    start = (-base.data_ptr() % 64) // t.element_size() + shift
    return base[start: start + t.numel()].copy_(t.reshape(-1)).view(t.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_write_launched_as_compiled_fits_any_alignment_and_stride(dtype):
    """The cache write's kernel is compiled at the first call of a signature and launched directly
    after it (`triton_cache`). Later calls of that signature whose tensors start off 16-byte
    boundaries, or whose rows are an odd number of elements apart, must still write what the CPU
    path writes, bit for bit: a kernel specialised on the first call's alignment would not."""
    from compiled_attn.ops.cache import write_kv_cache
    from compiled_attn.ops.triton_cache import write_kv_cache_cuda

    g = torch.Generator().manual_seed(3)
    n, row = 9, HKV * D
    slots = torch.randperm(NB * BS, generator=g)[:n]
    slots[[2, 6]] = -1
    key, value = (torch.randn(n, HKV, D, generator=g).to(dtype) for _ in range(2))
    fused = torch.randn(n, 2 * row + 3, generator=g).to(dtype)  # [k | v | 3 spare]: rows 2 * row + 3 apart
    fused_cuda = placed(fused, 0)
    cases = {  # name: (key, value on the CPU), (key, value, shift of the cache and slots on CUDA); aligned first
        "aligned": ((key, value), (placed(key, 0), placed(value, 0), 0)),
        "odd row strides": ((fused[:, :row].view(n, HKV, D), fused[:, row: 2 * row].view(n, HKV, D)),
                            (fused_cuda[:, :row].view(n, HKV, D), fused_cuda[:, row: 2 * row].view(n, HKV, D), 0)),
        "every tensor off 16 bytes": ((key, value), (placed(key, 1), placed(value, 1), 1)),
    }
    # the cases are what they say: rows 35 elements apart, every pointer off a 16-byte boundary
    assert cases["odd row strides"][1][0].stride(0) % 16 and cases["every tensor off 16 bytes"][1][0].data_ptr() % 16
    for name, ((k, v), (k_cuda, v_cuda, shift)) in cases.items():
        expected = random_cache(seed=4, dtype=dtype)
        cache = placed(expected, shift)
        write_kv_cache(k, v, expected, slots, 1.0, 1.0)  # the CPU path: masked index_put
        write_kv_cache_cuda(k_cuda, v_cuda, cache, placed(slots, shift), 1.0, 1.0)
        assert same_bits(cache, expected), name


def test_cache_write_compiles_once_per_key_then_launches_as_compiled(monkeypatch):
    """The launch logic of `write_kv_cache_cuda` on the CPU, with Triton's JIT and compiled kernel
    stood in for: the first call of a (device, dtypes, row size, ALIGNED) key goes through the JIT
    (which compiles and launches), every later call of that key launches the compiled kernel with
    the same constexprs and this call's grid and arguments, and a call whose rows are off 16-byte
    boundaries is a new key (its own kernel), never the aligned one's."""
    triton = pytest.importorskip("triton")
    from compiled_attn.ops import triton_cache

    launches = []

    class Compiled:  # what JITFunction.run returns: launched as `kernel[grid](*args)`
        def __init__(self, aligned):
            self.aligned = aligned

        def __getitem__(self, grid):
            return lambda *args: launches.append(("compiled", self.aligned, grid, args))

    class Jit:
        def __getitem__(self, grid):
            def run(*args):
                launches.append(("jit", args[-1], grid, args))
                return Compiled(args[-1])
            return run

    monkeypatch.setattr(triton_cache, "_write_kv_kernel", Jit())
    monkeypatch.setattr(triton_cache, "_compiled", {})
    n, row = 5, HKV * D  # a 64-byte row: aligned wherever the tensors start on 16 bytes
    slots = torch.arange(n)
    cache = random_cache(dtype=torch.float32)
    fused = torch.randn(n, 2 * row + 1)  # k and v column slices, rows 68 bytes apart: not aligned
    aligned = (torch.randn(n, HKV, D), torch.randn(n, HKV, D))
    unaligned = (fused[:, :row].view(n, HKV, D), fused[:, row: 2 * row].view(n, HKV, D))
    assert triton_cache.rows_aligned(*aligned, cache, row) and not triton_cache.rows_aligned(*unaligned, cache, row)
    for k, v in (aligned, aligned, unaligned, aligned, unaligned):
        triton_cache.write_kv_cache_cuda(k, v, cache, slots[: k.shape[0]], 1.0, 1.0)
    assert [(how, a) for how, a, _, _ in launches] == [
        ("jit", True), ("compiled", True), ("jit", False), ("compiled", True), ("compiled", False)]
    for how, a, grid, args in launches:
        assert grid == ((n,) if how == "jit" else (n, 1, 1))
        assert args[-4:] == (row, triton.next_power_of_2(row), False, a)  # ROW, BLOCK, SCALE, ALIGNED
        assert args[4] == args[0].stride(0) and args[6] == cache.stride(0)


def test_rows_aligned_names_what_vector_accesses_need():
    """`ALIGNED` (16-byte loads and stores in the cache write) only where every row starts on a
    16-byte boundary: each tensor's start, each row stride and the cache's row size, in bytes."""
    pytest.importorskip("triton")
    from compiled_attn.ops.triton_cache import rows_aligned

    def shifted(shape, dtype=torch.bfloat16, by=0):  # alignment is all that counts here, not values
        return placed(torch.empty(shape, dtype=dtype), by, "cpu")

    key, value, cache = shifted((3, 2, 64)), shifted((3, 2, 64)), shifted((2, 4, 16, 2, 64))
    assert rows_aligned(key, value, cache, 128)
    assert not rows_aligned(shifted((3, 2, 64), by=1), value, cache, 128)  # a start 2 bytes off
    assert not rows_aligned(key, value, shifted((2, 4, 16, 2, 64), by=4), 128)  # 8 bytes off
    fused = shifted((3, 2 * 128 + 4))  # rows 520 bytes apart: not a multiple of 16
    assert not rows_aligned(fused[:, :128].view(3, 2, 64), value, cache, 128)
    assert not rows_aligned(key, value, cache, 124)  # a row of 248 bytes
    fp8 = shifted((2, 4, 16, 2, 64), torch.float8_e4m3fn)
    assert rows_aligned(key, value, fp8, 128) and not rows_aligned(key, value, fp8, 120)  # 120 one-byte entries


def test_cache_write_vectorizes_on_alignment_it_was_told():
    """The cache write's kernel is compiled with no specialisation of its arguments (it is launched
    as compiled later, `triton_cache`), so its 16-byte loads and stores come from `ALIGNED` alone:
    the PTX for sm90 (compiled on the CPU with Triton's own ptxas) has them with it and none
    without, where each thread moves 2-byte elements one at a time."""
    triton = pytest.importorskip("triton")
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from compiled_attn.ops.triton_cache import _write_kv_kernel

    def memory_ops(aligned: bool) -> dict[str, int]:
        types = ["*bf16", "*bf16", "*bf16", "*i64", "i64", "i64", "i64", "fp32", "fp32"]
        constexprs = {"ROW": 1024, "BLOCK": 1024, "SCALE": False, "ALIGNED": aligned}  # 8 per thread
        names = _write_kv_kernel.arg_names
        signature = {**dict(zip(names[: len(types)], types, strict=True)), **dict.fromkeys(constexprs, "constexpr")}
        source = ASTSource(fn=_write_kv_kernel, signature=signature,
                           constexprs={(names.index(k),): v for k, v in constexprs.items()})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        return {op: len(re.findall(rf"{op}\.global\S*\.v4\.b32", ptx)) for op in ("ld", "st")} | {
            "scalar": len(re.findall(r"(?:ld|st)\.global\S*\.b16", ptx))}

    assert memory_ops(True) == {"ld": 2, "st": 2, "scalar": 0}
    unaligned = memory_ops(False)
    assert unaligned["ld"] == unaligned["st"] == 0 and unaligned["scalar"] > 0, unaligned


def interpreter_write_cases() -> None:
    """Run by `test_cuda_write_logic_through_the_interpreter` in a process with TRITON_INTERPRET=1:
    `write_kv_cache_cuda` (the CUDA path's Python side and kernel) on CPU tensors, against the
    CPU write, bit for bit: pads skipped, rows read through their strides (a fused projection's
    column slices), strided heads copied first, no tokens writing nothing."""
    from compiled_attn.ops.cache import write_kv_cache
    from compiled_attn.ops.triton_cache import write_kv_cache_cuda

    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([5, -1, 0, 63, 17, -1, 40])
    n = len(slots)
    fused = torch.randn(n, 4 * HKV * D, generator=g)  # [q | k | v | spare] columns
    cases = {
        "contiguous": (torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)),
        "fused column slices": (fused[:, HKV * D: 2 * HKV * D].view(n, HKV, D),
                                fused[:, 2 * HKV * D: 3 * HKV * D].view(n, HKV, D)),
        "strided heads": (torch.randn(n, D, HKV, generator=g).transpose(1, 2),
                          torch.randn(n, D, HKV, generator=g).transpose(1, 2)),
    }
    for name, (key, value) in cases.items():
        assert name != "fused column slices" or key.stride(0) == 4 * HKV * D
        for dtype in (torch.float32, torch.float16):
            expected = random_cache(seed=1, dtype=dtype)
            got = expected.clone()
            write_kv_cache(key, value, expected, slots, 1.0, 1.0)  # the CPU path: masked index_put
            write_kv_cache_cuda(key, value, got, slots, 1.0, 1.0)
            assert same_bits(got, expected), (name, dtype)
    untouched = random_cache(seed=2)
    got = untouched.clone()
    write_kv_cache_cuda(torch.empty(0, HKV, D), torch.empty(0, HKV, D), got, slots[:0], 1.0, 1.0)
    assert same_bits(got, untouched)


def test_cuda_write_logic_through_the_interpreter():
    """The CUDA cache write's launch logic and kernel on the CPU (Triton's interpreter), so that CI
    covers what the gpu-marked test above checks on a device."""
    run_under_interpreter("import test_cache_ops as t; t.interpreter_write_cases()", 300)

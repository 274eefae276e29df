"""xFormers' cutlass op with a dense ALiBi bias and GQA-expanded K/V vs float64, raw and as the backend calls it.

    python scripts/xf_alibi_probe.py        (CUDA; prints one line per shape, BAD where rel err > 1e-2)

On an H200 and an H100 (torch 2.11, xFormers 0.0.35) the raw call with stride-0 K/V heads was
wrong (rel err 0.15-0.26) whenever the query length left a partial last query tile (33 or 65 rows
at head 256, 65 at head 128, 3 query heads per KV head); `run_xformers` passes it through
`cutlass_safe` (contiguous K/V), which was exact there. Then, for the bench's fresh prefill: which
kernel takes it and what the copies cost. (One KV group per call here: the side streams xFormers
uses for several groups are read from its source, not measured.)
"""

import itertools

import torch
from xformers.ops.fmha import attn_bias as ab

from compiled_attn.bench.timing import eager_time_us
from compiled_attn.ops.common import alibi_bias
from compiled_attn.ops.xformers import _not_supported, cutlass_safe, expanded, fmha, grouped, run_xformers


def reference(q, k, v, bias, scale):
    s = torch.einsum("mhd,nhd->hmn", q.double(), k.double()) * scale + bias.double()
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v.double())


def raw_cutlass(q, k, v, bias, scale):
    f = fmha()
    inp = f.Inputs(query=q, key=k, value=v, attn_bias=bias, p=0.0, scale=scale)
    return f.cutlass.FwOp.apply(inp, needs_gradient=False)[0]


def backend_cutlass(q, k, v, bias, scale):
    return run_xformers(q, k, v, bias, scale, ("cutlass",))


CALLS = {"raw": raw_cutlass, "backend": backend_cutlass}
torch.manual_seed(0)
for d, hpg, lq, call in itertools.product((128, 256), (1, 3), (32, 33, 64, 65), CALLS):
    q = torch.randn(1, lq, hpg, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(lq, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(hpg)], device="cuda")[None, :, None, None]
    rel = (torch.arange(lq, device="cuda")[None, :] - torch.arange(lq, device="cuda")[:, None]).float()
    bias = torch.empty(1, hpg, lq, -(-lq // 8) * 8, device="cuda", dtype=torch.bfloat16)[..., :lq]
    bias.copy_(alibi_bias(slopes, rel, rel <= 0))
    kk, vv = expanded(k, hpg)[:, :, 0], expanded(v, hpg)[:, :, 0]  # [1, lq, hpg, d], head stride 0
    scale = d**-0.5
    out = CALLS[call](q, kk, vv, bias, scale)
    ref = reference(q[0], k.expand(lq, hpg, d), v.expand(lq, hpg, d), bias[0], scale)
    err = ((out[0].double() - ref).norm() / ref.norm()).item()
    print(f"head {d}, {hpg} q heads per kv head, {lq} rows, {call}: rel err {err:.3e} {'BAD' if err > 1e-2 else 'ok'}")

# The bench's fresh prefill (8 x 2048, 32 q / 8 kv heads, head 128)
f = fmha()
n, g, hpg, d = 8 * 2048, 8, 4, 128
q = grouped(torch.randn(n, g * hpg, d, device="cuda", dtype=torch.bfloat16), g)
k, v = (expanded(torch.randn(n, g, d, device="cuda", dtype=torch.bfloat16), hpg) for _ in range(2))
mask = ab.BlockDiagonalCausalMask.from_seqlens([2048] * 8, device="cuda")
inp = f.Inputs(query=q, key=k, value=v, attn_bias=mask, p=0.0, scale=d**-0.5)
for op in (f.flash.FwOp, f.cutlass.FwOp):
    print(f"prefill 8 x 2048: {op.NAME} refuses: {_not_supported(op, inp) or 'no'}")
timings = {
    "as the backend calls it (flash, else cutlass)": lambda: run_xformers(q, k, v, mask, d**-0.5, ("flash", "cutlass")),
    "cutlass, 5-D stride-0 K/V": lambda: f.cutlass.FwOp.apply(inp, False),
    "cutlass_safe": lambda: f.cutlass.FwOp.apply(cutlass_safe(inp), False),
}
for label, fn in timings.items():
    print(f"prefill 8 x 2048, {label}: {eager_time_us(fn, iters=20):.0f} us")

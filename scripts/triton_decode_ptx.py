"""What our Triton decode kernel compiles to on sm90, read on a machine without a GPU.

Triton compiles for a target it is told (`GPUTarget("cuda", 90, 32)`) with the `ptxas` its wheel
ships, so the PTX of every launch shape can be read on the CPU: which MMA each product gets
(Hopper's warpgroup `wgmma` or the older `mma.sync`), whether the K/V tiles are pipelined
(`cp.async` and its width), the shared memory a program takes, and the per-tile instructions an
fp8 cache adds (byte-wise shared loads, conversions). Times need the GPU
(`decode_flashinfer --triton-sweep`); this says why two shapes differ.

Arguments are specialized as a launch over our caches specializes them: every pointer 16-byte
aligned and every stride a multiple of 16. The device's Triton may differ from this machine's.

`--sass` adds what the wheel's `cuobjdump` and `nvdisasm` read from the cubin: registers a thread,
the programs an H100 / H200 SM holds by registers and shared memory, and the SASS instructions of
the kernel's main loop (the longest backward branch: one tile), with its conversions, shared loads
and MMAs. Those are what bound an fp8 tile once its bytes halve.

    python scripts/triton_decode_ptx.py [--block-n 64 128] [--warps 4] [--stages 3] [--group 4]
        [--caches bf16 e4m3 e5m2] [--sass]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections import Counter
from itertools import product
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from compiled_attn.ops.triton_decode import _pairs_kernel, _split_kernel

ARGS = ("q_ptr", "k_ptr", "v_ptr", "table_ptr", "lens_ptr", "out_ptr", "part_ptr", "lse_ptr",
        "q_stride_t", "q_stride_h", "kv_stride_blk", "kv_stride_tok", "kv_stride_h", "table_stride",
        "out_stride_t", "out_stride_h", "qk_scale", "v_scale", "num_splits")
# what a launch over our caches finds divisible by 16 (num_splits and the scales are not)
DIVISIBLE = ARGS[:16]
CACHE_TYPES = {"bf16": "*bf16", "e4m3": "*fp8e4nv", "e5m2": "*fp8e5"}
# an asynchronous global -> shared copy of `size` bytes: cp.async.{ca,cg}.shared.global [dst], [src], size
COPY = r"cp\.async\.c[ag]\.shared\.global\S*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*{size}\b"
COUNTED = {
    "wgmma": r"wgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "cp.async 16B": COPY.format(size="(?:16|0x10)"),
    "cp.async 8B": COPY.format(size="(?:8|0x8)"),
    "cp.async 4B": COPY.format(size="(?:4|0x4)"),
    "ld.shared 8-bit": r"ld\.shared(?:\.v\d)?\.[bsu]8\b",
    "ld.shared.b16": r"ld\.shared\.b16",
    "prmt": r"\bprmt\.b32",
    "fp8 cvt": r"cvt\.rn\.f16x2\.e(?:4m3|5m2)x2",
    "cvt.bf16.f16": r"cvt\.bf16\.f16",
}


def compile_shape(cache: str, fp16_mma: bool, block_n: int, warps: int, stages: int, group: int,
                  head_size: int = 128, direct: bool = False) -> triton.compiler.CompiledKernel:
    """`_split_kernel` for sm90 at one launch shape, over bf16 queries and a `cache` cache
    (`fp16_mma`: `_pairs_kernel`, an fp8 cache's pairs widened to fp16, `DecodeConfig.fp16_mma`)."""
    types = ["*bf16", CACHE_TYPES[cache], CACHE_TYPES[cache], "*i32", "*i32", "*bf16", "*fp32", "*fp32",
             *["i32"] * 8, "fp32", "fp32", "i32"]
    constexprs = {"GROUP": group, "BLOCK_H": max(16, triton.next_power_of_2(group)), "D": head_size, "PAGE": 16,
                  "BLOCK_N": block_n, "DIRECT": direct} | ({"E5M2": cache == "e5m2"} if fp16_mma else {})
    signature = {**dict(zip(ARGS, types, strict=True)), **dict.fromkeys(constexprs, "constexpr")}
    attrs = {(ARGS.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE}
    source = ASTSource(fn=_pairs_kernel if fp16_mma else _split_kernel, signature=signature, constexprs=constexprs,
                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def row(kernel: triton.compiler.CompiledKernel) -> dict[str, int]:
    """PTX instructions (all, and COUNTED's) and shared memory of one compiled shape."""
    ptx = kernel.asm["ptx"]
    counts = {name: len(re.findall(pattern, ptx)) for name, pattern in COUNTED.items()}
    lines = (line.strip() for line in ptx.splitlines())
    body = [line for line in lines if line and not line.startswith(("//", ".", "$", "{", "}"))]
    return {"instructions": len(body), "shared KB": kernel.metadata.shared // 1024, **counts}


# sm90: 64K 32-bit registers and 227 KB of shared memory a block may use, per SM (programs an SM holds is
# an upper bound from these: allocation granularity and the per-block reserve are left out)
SM_REGISTERS, SM_SHARED_BYTES = 65536, 227 * 1024
SASS_COUNTED = ("F2FP", "PRMT", "LDSM", "LDS", "STS", "HMMA", "BAR")
# an instruction line of `nvdisasm -c`: /*0a30*/  [@P0] OPCODE ...
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_row(kernel: triton.compiler.CompiledKernel, warps: int) -> dict[str, int]:
    """Registers a thread, programs an SM holds, and the main loop's SASS (all, and SASS_COUNTED's),
    from the cubin with the `cuobjdump` and `nvdisasm` beside Triton's `ptxas`."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
        listing = subprocess.run([tools / "nvdisasm", "-c", cubin.name], capture_output=True, text=True,
                                 check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    programs = min(SM_REGISTERS // (registers * 32 * warps), SM_SHARED_BYTES // max(kernel.metadata.shared, 1),
                   64 // warps)
    opcodes, labels, loops = [], {}, []
    for line in listing.splitlines():
        if label := re.match(r"^(\.L_x_\d+):", line.strip()):
            labels[label.group(1)] = len(opcodes)
        elif op := SASS_LINE.match(line):
            target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
            if target and labels.get(target.group(1), len(opcodes)) < len(opcodes):  # a branch backwards
                loops.append((labels[target.group(1)], len(opcodes)))
            opcodes.append(op.group(1))
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    body = Counter(opcodes[start : end + 1])
    return {"registers": registers, "programs / SM": programs, "loop SASS": end + 1 - start,
            **{f"loop {op}": body[op] for op in SASS_COUNTED}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", type=int, nargs="+", default=[3])
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--caches", nargs="+", choices=list(CACHE_TYPES), default=["bf16", "e4m3"])
    parser.add_argument("--sass", action="store_true", help="registers, occupancy and the main loop's SASS too")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm90, GQA group {args.group}, head size 128")
    table = {}
    for cache, fp16_mma, block_n, warps, stages in product(args.caches, (False, True), args.block_n, args.warps,
                                                           args.stages):
        if fp16_mma and cache == "bf16":
            continue
        shape = f"{cache}{' fp16' if fp16_mma else ''} n{block_n} w{warps} st{stages}"
        kernel = compile_shape(cache, fp16_mma, block_n, warps, stages, args.group)
        table[shape] = row(kernel) | (sass_row(kernel, warps) if args.sass else {})
    columns = list(next(iter(table.values())))
    print(f"{'shape':<30}" + "".join(f"{c:>14}" for c in columns))
    for shape, counts in table.items():
        print(f"{shape:<30}" + "".join(f"{counts[c]:>14}" for c in columns))


if __name__ == "__main__":
    main()

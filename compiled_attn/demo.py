"""`python -m compiled_attn demo`: the reference model served eagerly and compiled, compared.

A batch of requests goes through prefill and greedy decode steps on the best backend of this
machine; the compiled model (`fullgraph=True, dynamic=True`) must agree with eager: the same
greedy tokens in fp32, teacher-forced logits within tolerance in bf16. On CUDA the compiled
model also serves the decode steps through `CUDAGraphRunner` (teacher-forced, checked the same way;
sharded, with the all-reduces inside the graphs).

With `tp` > 1 the demo runs on `tp` spawned processes (one per GPU with NCCL, or gloo on CPU),
each serving its shard of the model; the sharded model is also checked against the unsharded
one (teacher-forced logits), and rank 0 reports.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

import compiled_attn as ca
from compiled_attn import distributed
from compiled_attn.base import ENV_VAR
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.models import tp as tpm
from compiled_attn.models.llama import LlamaConfig, allocate_kv_caches, build_model
from compiled_attn.paging import BlockAllocator, Request, last_token_rows, schedule


@dataclasses.dataclass
class RunResult:
    tokens: list[list[int]]  # generated tokens per request
    logits: list[torch.Tensor]  # per step, [num_requests, vocab] (fp32, on CPU)
    decode_seconds: float  # wall time of the decode steps (after the first, which may compile)
    decode_tokens: int
    first_step_seconds: float  # the prefill step: includes compilation for a compiled model
    capture_seconds: float = 0.0  # CUDA-graph capture (graphs=True)


def generate(
    model: torch.nn.Module,
    backend: type[ca.AttentionBackend],
    spec: ca.AttentionSpec,
    prompts: list[list[int]],
    steps: int,
    *,
    forced: list[list[int]] | None = None,
    graphs: bool = False,
    group: dist.ProcessGroup | None = None,
) -> RunResult:
    """Prefill `prompts`, then `steps` greedy decode steps; `forced` feeds given tokens instead
    of the model's own (teacher forcing), so two runs see identical inputs. `graphs` serves the
    steps through a `CUDAGraphRunner` (decodes replay graphs, the prefill runs eagerly); `group`:
    the tensor-parallel group of a sharded `model` (every rank captures the same sizes)."""
    caches = allocate_kv_caches(model.config, backend, spec)
    runner, capture_seconds = None, 0.0
    if graphs:
        sizes = [n for n in (1, 2, 4, 8, 16, 32) if n < 2 * len(prompts)]
        # off CUDA the runner replays the same padded static-buffer step without capturing it
        runner = CUDAGraphRunner(model, backend, spec, caches, capture_sizes=sizes, max_batch_size=max(sizes),
                                 use_cuda_graphs=spec.device.type == "cuda", progress=False)
        capture_seconds = distributed.capture_sharded(runner, group)["seconds"]
    allocator = BlockAllocator(spec.num_blocks, spec.block_size)
    builder = backend.get_builder_cls()(spec)
    requests = [Request(tokens=list(p)) for p in prompts]
    out = RunResult([[] for _ in prompts], [], 0.0, 0, 0.0, capture_seconds)
    sync = torch.cuda.synchronize if spec.device.type == "cuda" else (lambda: None)
    for step in range(steps + 1):
        seq_lens, query_lens, tables, ids, pos = schedule(requests, allocator, spec.device)
        md = builder.build(seq_lens, query_lens, tables)
        ca.mark_token_dim(ids, pos)  # a 1-token batch must not specialise the graph
        sync()
        t0 = time.perf_counter()
        if runner is not None:
            # the row selection copies: the runner need not copy its output first
            logits = runner.run(md, ids, pos, copy_output=False)[last_token_rows(query_lens)]
        else:
            with ca.floats_as_constants(), ca.set_forward_context(md):
                logits = model(ids, pos, caches)[last_token_rows(query_lens)]
        next_tokens = logits.argmax(-1).tolist()  # the host needs the tokens: this syncs
        elapsed = time.perf_counter() - t0
        if step == 0:
            out.first_step_seconds = elapsed
        else:
            out.decode_seconds += elapsed
            out.decode_tokens += len(requests)
        out.logits.append(logits.float().cpu())
        for i, r in enumerate(requests):
            r.num_computed = len(r.tokens)
            token = forced[i][step] if forced is not None else next_tokens[i]
            r.tokens.append(token)
            out.tokens[i].append(token)
    return out


NUM_BLOCKS, BLOCK_SIZE, MAX_PROMPT = 512, 16, 47  # the demo's cache and longest prompt


def demo_config(cuda: bool) -> LlamaConfig:
    """The demo's model: 8 layers of 1024 on a GPU, 2 tiny layers on CPU."""
    if cuda:
        return LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=8,
                           num_heads=16, num_kv_heads=4)
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2)


def check_demo_args(*, steps: int, num_requests: int = 6, backend_name: str | None = None, tp: int = 1,
                    device: str | None = None) -> None:
    """ValueError (or the registry's error for a backend name) for arguments the demo would fail
    on only after running: no decode step to time, more tokens than its cache holds, or a `tp`
    that does not split the model's heads, intermediate size and vocabulary (of the model for
    `device`, default where `run_ranks` puts the ranks)."""
    if tp > 1:
        config = demo_config(_ranks_device_type(tp, device) == "cuda")
        tpm.local_head_counts(config.num_heads, config.num_kv_heads, tp)
        for name in ("intermediate_size", "vocab_size"):
            tpm.check_divisible(name, getattr(config, name), tp)
    if steps < 1 or num_requests < 1:
        raise ValueError(f"the demo needs steps >= 1 and num_requests >= 1, got {steps} and {num_requests}")
    blocks = num_requests * -(-(MAX_PROMPT + steps + 1) // BLOCK_SIZE)
    if blocks > NUM_BLOCKS:
        most = NUM_BLOCKS // num_requests * BLOCK_SIZE - MAX_PROMPT - 1
        raise ValueError(f"{steps} steps of {num_requests} requests need {blocks} cache blocks, the demo's cache "
                         f"has {NUM_BLOCKS}: use --steps <= {most}")
    if backend_name is not None or os.environ.get(ENV_VAR):  # the run would pick $COMPILED_ATTN_BACKEND's
        ca.get_attn_backend(backend_name)


def run_demo(*, steps: int = 16, num_requests: int = 6, seed: int = 0, backend_name: str | None = None,
             tp: int = 1, device: str | None = None) -> dict:
    """Run the demo and return its summary row (also used by tests); `tp` > 1 shards the model
    over that many spawned processes (GPUs with NCCL when there are enough, else CPU with gloo)."""
    check_demo_args(steps=steps, num_requests=num_requests, tp=tp, device=device)
    if tp == 1:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return _demo(None, device, steps, num_requests, seed, backend_name)
    return distributed.run_ranks(_demo, tp, steps, num_requests, seed, backend_name,
                                 device_type=_ranks_device_type(tp, device))[0]


def _ranks_device_type(tp: int, device: str | None) -> str:
    """The device type `tp` ranks run on: `device`'s (each rank takes its own index), else where
    `run_ranks` puts them by default."""
    return torch.device(device).type if device is not None else distributed.default_device_type(tp)


def _demo(group: dist.ProcessGroup | None, device: torch.device, steps: int, num_requests: int, seed: int,
          backend_name: str | None) -> dict:
    """The demo on one process: the whole model, or this rank's shard of it."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = demo_config(cuda)
    tp_size = tpm.layout_of(group).size
    # graphs serve sequences up to max_seq_len_to_capture: the longest prompt (47) plus the steps
    # (TORCH_SDPA's graph reads that many keys per request whatever the live lengths)
    spec = config.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=dtype, device=device,
                                 tp_size=tp_size,
                                 max_seq_len_to_capture=-(-(MAX_PROMPT + 1 + steps) // BLOCK_SIZE) * BLOCK_SIZE)
    backend = ca.get_attn_backend(backend_name, spec)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, MAX_PROMPT + 1, (num_requests,), generator=g).tolist()
    prompts = [torch.randint(config.vocab_size, (n,), generator=g).tolist() for n in lens]
    model = build_model(config, seed=seed, backend=backend.get_name(), dtype=dtype, device=device, tp_group=group)

    eager = generate(model, backend, spec, prompts, steps)
    if tp_size > 1:
        sharding_err = _sharding_error(config, backend, dtype, device, seed, prompts, eager)
    torch._dynamo.reset()
    compiled_model = torch.compile(model, fullgraph=True, dynamic=True)
    exact = dtype == torch.float32
    compiled = generate(compiled_model, backend, spec, prompts, steps, forced=None if exact else eager.tokens)
    if exact:
        agree = compiled.tokens == eager.tokens
        check = "same greedy tokens" if agree else "greedy tokens DIFFER"
    else:
        errs = [((c - e).norm() / e.norm()).item() for c, e in zip(compiled.logits, eager.logits, strict=True)]
        agree = max(errs) <= 2e-2
        check = f"teacher-forced logits max rel err {max(errs):.2e}"
    if tp_size > 1:
        # fp32: only the all-reduce order differs from the unsharded model; bf16: also the
        # rounding of the partial sums
        limit = 1e-4 if exact else 2e-2
        agree = agree and sharding_err <= limit
        check += f"; sharded vs unsharded logits max rel err {sharding_err:.2e}"
    row = {
        "backend": backend.get_name(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "tp": tp_size,
        "dtype": str(dtype).removeprefix("torch."),
        "requests": num_requests,
        "steps": steps,
        "eager tok/s": eager.decode_tokens / eager.decode_seconds,
        "compiled tok/s": compiled.decode_tokens / compiled.decode_seconds,
        "compile s": compiled.first_step_seconds,
    }
    if cuda:
        graphed = generate(compiled_model, backend, spec, prompts, steps, forced=eager.tokens, graphs=True,
                           group=group)
        errs = [((c - e).norm() / e.norm()).item() for c, e in zip(graphed.logits, eager.logits, strict=True)]
        agree = agree and max(errs) <= 2e-2
        check += f"; graphs vs eager logits max rel err {max(errs):.2e}"
        row["graphs tok/s"] = graphed.decode_tokens / graphed.decode_seconds
        row["capture s"] = graphed.capture_seconds
    return row | {"check": check, "agree": agree}


def _sharding_error(config: LlamaConfig, backend: type[ca.AttentionBackend], dtype: torch.dtype,
                    device: torch.device, seed: int, prompts: list[list[int]], sharded: RunResult) -> float:
    """Max relative error of the sharded eager logits against the unsharded model of the same
    seed on this rank's device, teacher-forced on the sharded run's tokens."""
    spec = config.attention_spec(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=dtype, device=device)
    model = build_model(config, seed=seed, backend=backend.get_name(), dtype=dtype, device=device)
    full = generate(model, backend, spec, prompts, len(sharded.logits) - 1, forced=sharded.tokens)
    return max(((s - f).norm() / f.norm()).item() for s, f in zip(sharded.logits, full.logits, strict=True))

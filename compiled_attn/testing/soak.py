"""Soak: thousands of steps of the reference model through `CUDAGraphRunner`, requests joining and leaving.

Requests arrive at random, are prefilled eagerly, decode through the captured graphs (their
tokens are the runner's own greedy picks) and leave at a random length, handing their blocks
back to the allocator, so later requests reuse blocks that earlier ones wrote. Every
`check_every` steps the next graph step is also run eagerly on a copy of the caches: its logits
must match, and the caches may differ only at the slots that step wrote. Live GPU memory is
sampled at each check and must stay flat; any non-finite logit fails the run.

Example::

    report = run_soak(model, backend, spec, SoakConfig(steps=10_000))
    assert report.ok, report.failures
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import random

import torch

from compiled_attn.abstract import AttentionBackend, AttentionMetadata, AttentionSpec
from compiled_attn.forward_context import set_forward_context
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.graphs.buckets import GRAPH, choose_path
from compiled_attn.paging import BlockAllocator, Request, last_token_rows, schedule
from compiled_attn.testing.agreement import near_tie

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """Traffic and checks of one soak run (defaults: ~16 requests live; on CPU ~95% of steps took graphs)."""

    steps: int = 10_000
    check_every: int = 100
    seed: int = 0
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24)
    max_live: int = 20  # requests served at once (the largest capture size, 24, holds them all)
    join_probability: float = 0.04  # per step; 1-3 requests join (their prefill makes the step eager)
    prompt_lens: tuple[int, int] = (2, 48)
    output_lens: tuple[int, int] = (8, 400)
    long_probability: float = 0.01  # a request that outgrows spec.max_seq_len_to_capture (eager steps)
    long_len: int = 600
    rel_tol: float = 2e-2  # logits, graph vs eager on the same caches (16-bit models)
    memory_slack_bytes: int = 1 << 20  # per-step metadata a State keeps alive may differ in size

    def max_seq_len(self) -> int:
        return max(self.long_len, self.prompt_lens[1] + self.output_lens[1])


@dataclasses.dataclass
class SoakReport:
    steps: int = 0
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # runner paths
    requests_served: int = 0
    checks: int = 0
    worst_rel_err: float = 0.0
    top1_agree: int = 0  # checked rows whose greedy token is the eager one's
    top1_rows: int = 0
    decodes_on_eager_kernel: bool = True  # the runner's graphs (`min_top1_agreement`)
    nonfinite_requests: int = 0  # live rows whose next-token logits were not all finite
    memory_samples: list[int] = dataclasses.field(default_factory=list)  # memory_allocated at each check
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def top1_agreement(self) -> float:
        return self.top1_agree / self.top1_rows if self.top1_rows else 1.0

    @property
    def memory_growth(self) -> int:
        """Largest spread of live memory over the checks after the first tenth of them (the early
        ones follow lazy setup: kernel autotuning, allocator warm-up, planning buffers)."""
        later = self.memory_samples[max(1, len(self.memory_samples) // 10):]
        return max(later) - min(later) if later else 0


def soak_num_blocks(spec_block_size: int, config: SoakConfig) -> int:
    """Enough blocks for `max_live` requests of the longest length at once."""
    return config.max_live * -(-config.max_seq_len() // spec_block_size) + 1


class _Traffic:
    """Requests that join at random, decode, and leave at their target length, over one allocator."""

    def __init__(self, config: SoakConfig, spec: AttentionSpec, vocab_size: int) -> None:
        self.config, self.spec, self.vocab = config, spec, vocab_size
        self.rng = random.Random(config.seed)
        self.allocator = BlockAllocator(spec.num_blocks, spec.block_size)
        self.live: list[tuple[Request, int]] = []  # (request, target length)
        self.served = 0

    def _blocks(self, n: int) -> int:
        return -(-n // self.spec.block_size)

    def next_batch(self) -> tuple[list[Request], int]:
        """The step's requests (new ones first: prefills precede decodes) and how many are new."""
        c, rng = self.config, self.rng
        joining = []
        if not self.live or rng.random() < c.join_probability:
            # reserve every live request's whole target so that no step can run out of blocks
            reserved = sum(self._blocks(t) - len(r.block_table) for r, t in self.live)
            for _ in range(rng.randint(1, 3)):
                if len(self.live) + len(joining) >= c.max_live:
                    break
                prompt = [rng.randrange(self.vocab) for _ in range(rng.randint(*c.prompt_lens))]
                long = rng.random() < c.long_probability
                target = c.long_len if long else len(prompt) + rng.randint(*c.output_lens)
                if reserved + self._blocks(target) > len(self.allocator.free):
                    break
                reserved += self._blocks(target)
                joining.append((Request(tokens=prompt), target))
        self.live = joining + self.live
        return [r for r, _ in self.live], len(joining)

    def advance(self, tokens: list[int]) -> None:
        """Append each live request's next token; requests at their target leave and free their blocks."""
        kept = []
        for (r, target), tok in zip(self.live, tokens, strict=True):
            r.num_computed = len(r.tokens)
            r.tokens.append(tok)
            if len(r.tokens) >= target:
                self.allocator.release(r.block_table)
                self.served += 1
            else:
                kept.append((r, target))
        self.live = kept


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _caches_differ_outside(after: list[torch.Tensor], before: list[torch.Tensor], slots: torch.Tensor) -> bool:
    """Whether any cache byte outside `slots` differs (bitwise, NaN-safe)."""
    for a, b in zip(after, before, strict=True):
        keep = torch.ones(a.shape[1] * a.shape[2], dtype=torch.bool, device=a.device)
        keep[slots] = False
        fa, fb = a.view(2, -1, *a.shape[3:]), b.view(2, -1, *b.shape[3:])  # [2, num_blocks * block_size, H, D]
        if not torch.equal(fa[:, keep].view(torch.uint8), fb[:, keep].view(torch.uint8)):
            return True
    return False


def _check_step(
    runner: CUDAGraphRunner, model, md: AttentionMetadata, ids: torch.Tensor, pos: torch.Tensor,
    config: SoakConfig, report: SoakReport, step: int,
) -> torch.Tensor:
    """Run the step eagerly on copies of the caches and through the runner; compare logits and caches."""
    if runner.kv_caches[0].is_cuda:
        gc.collect()  # count live tensors, not garbage awaiting the cycle collector
        torch.cuda.synchronize()
        report.memory_samples.append(torch.cuda.memory_allocated())
    copies = [c.clone() for c in runner.kv_caches]
    with set_forward_context(md):
        want = model(ids, pos, copies)
    got = runner.run(md, ids, pos)
    err = _rel_err(got, want)
    report.worst_rel_err = max(report.worst_rel_err, err)
    tokens = got.argmax(-1)
    report.top1_agree += int((tokens == want.argmax(-1)).sum())
    report.top1_rows += got.shape[0]
    if not near_tie(want, tokens).all():
        report.failures.append(f"step {step}: a greedy token differs from eager's off a near-tie")
    report.checks += 1
    if err > config.rel_tol:
        report.failures.append(f"step {step}: logits rel err {err:.3e} > {config.rel_tol:.0e} (graph vs eager)")
    slots = md.slot_mapping[md.slot_mapping >= 0]
    if _caches_differ_outside(runner.kv_caches, copies, slots):
        report.failures.append(f"step {step}: the graph step changed cache bytes outside its {slots.numel()} slots")
    written = [(c.view(2, -1, *c.shape[3:])[:, slots], e.view(2, -1, *e.shape[3:])[:, slots])
               for c, e in zip(runner.kv_caches, copies, strict=True)]
    kv_err = max(_rel_err(c, e) for c, e in written)
    if kv_err > config.rel_tol:
        report.failures.append(f"step {step}: written K/V rel err {kv_err:.3e} (graph vs eager)")
    del copies
    return got


def run_soak(
    model: torch.nn.Module,
    backend: type[AttentionBackend],
    spec: AttentionSpec,
    config: SoakConfig | None = None,
    *,
    kv_caches: list[torch.Tensor],
    vocab_size: int,
    use_cuda_graphs: bool = True,
) -> SoakReport:
    """Serve `config.steps` steps of random traffic through a captured `CUDAGraphRunner`.

    model: `model(input_ids, positions, kv_caches) -> logits [num_tokens, vocab_size]` on
    `ca.Attention` layers of `backend`; kv_caches: one per layer (e.g. from
    `models.llama.allocate_kv_caches`, garbage-filled like a server's); spec.num_blocks at least
    `soak_num_blocks(spec.block_size, config)`. Returns a `SoakReport`; `report.failures` lists
    every check that failed (logits, cache bytes, written K/V, non-finite logits, memory growth).
    """
    config = config or SoakConfig()
    runner = CUDAGraphRunner(model, backend, spec, kv_caches, capture_sizes=list(config.capture_sizes),
                             max_batch_size=max(config.capture_sizes), use_cuda_graphs=use_cuda_graphs,
                             progress=False)
    runner.capture()
    builder = backend.get_builder_cls()(spec)
    traffic = _Traffic(config, spec, vocab_size)
    report = SoakReport(decodes_on_eager_kernel=runner.state.decodes_on_eager_kernel)
    nonfinite = torch.zeros((), dtype=torch.int64, device=spec.device)
    check_due = config.check_every
    for step in range(config.steps):
        requests, _ = traffic.next_batch()
        seq_lens, query_lens, tables, ids, pos = schedule(requests, traffic.allocator, spec.device)
        md = builder.build(seq_lens, query_lens, tables)
        path = choose_path(num_prefills=md.num_prefills, num_seqs=md.num_seqs, max_seq_len=md.max_seq_len,
                           largest_size=max(config.capture_sizes), max_seq_len_to_capture=spec.max_seq_len_to_capture)
        if step >= check_due and path == GRAPH:  # check graph steps: the eager ones are eager already
            logits = _check_step(runner, model, md, ids, pos, config, report, step)
            check_due += config.check_every  # a fixed schedule: a check delayed by eager steps does not shift the rest
        else:
            logits = runner.run(md, ids, pos)
        last = logits[last_token_rows(query_lens)]
        nonfinite += (~torch.isfinite(last).all(-1)).sum()
        traffic.advance(last.argmax(-1).tolist())
        report.steps += 1
    report.counts = dict(runner.counts)
    report.requests_served = traffic.served
    report.nonfinite_requests = int(nonfinite)
    if report.nonfinite_requests:
        report.failures.append(f"{report.nonfinite_requests} request steps got non-finite logits")
    if report.memory_growth > config.memory_slack_bytes:
        report.failures.append(f"live GPU memory moved by {report.memory_growth} bytes over the checks "
                               f"(samples {report.memory_samples[:3]} ... {report.memory_samples[-3:]})")
    logger.info("soak: %d steps, %s, %d checks, worst rel err %.2e, memory spread %d B", report.steps,
                report.counts, report.checks, report.worst_rel_err, report.memory_growth)
    return report

"""Running a function on N processes of one host, and capturing CUDA graphs across them.

`run_ranks` spawns one process per rank (NCCL on GPUs, gloo on CPU), joins them in a process
group and returns each rank's result: the sharded demo (`python -m compiled_attn demo --tp N`),
tests and scripts/tp_bench.py use it. `capture_sharded` captures a `CUDAGraphRunner` of a sharded
model after checking that every rank captures the same sizes (each graph holds collectives).
The tensor-parallel model itself is in `compiled_attn.models.tp`.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compiled_attn.validation import as_int


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous (the store listens on loopback only)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device_type(world_size: int) -> str:
    """Where `run_ranks` puts `world_size` ranks by default: "cuda" when there is a GPU for each,
    else "cpu"."""
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, device_type: str | None = None) -> list[Any]:
    """Run `fn(group, device, *args)` on `world_size` spawned processes and return their results
    (by rank; they must pickle). `fn` must be importable (module level).

    device_type "cuda": rank r uses cuda:r with an NCCL group; "cpu": gloo. Default: CUDA when
    there are at least `world_size` GPUs, else CPU.
    """
    world_size = as_int("world_size", world_size)  # before anything is spawned
    if device_type is None:
        device_type = default_device_type(world_size)
    if device_type not in ("cuda", "cpu"):  # rank r takes cuda:r: a device index or another type has no meaning here
        raise ValueError(f"device_type must be 'cuda' or 'cpu' (or None: {default_device_type(world_size)!r} "
                         f"here), got {device_type!r}")
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"{world_size} ranks on CUDA need {world_size} GPUs, found {torch.cuda.device_count()}")
    results = mp.get_context("spawn").SimpleQueue()
    ranks = mp.start_processes(
        _rank_main, args=(world_size, free_port(), device_type, fn, args, results), nprocs=world_size,
        join=False, start_method="spawn",
    )
    # Read while the ranks run: a large result fills the pipe and its rank waits for the reader.
    out: dict[int, Any] = {}
    exited = False
    while len(out) < world_size:
        if not results.empty():
            rank, blob = results.get()
            out[rank] = torch.load(io.BytesIO(blob), weights_only=False)
        elif exited:
            raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(out))} exited without a result")
        else:
            exited = ranks.join(timeout=0.05)  # re-raises a rank's exception, stopping the others
    while not ranks.join():
        pass
    return [out[r] for r in range(world_size)]


def _rank_main(rank: int, world_size: int, port: int, device_type: str, fn: Callable[..., Any], args: tuple,
               results: Any) -> None:
    """One spawned rank: join the group, run `fn`, report its result, leave the group."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        # serialised to bytes: tensors sent as-is would be shared through this process's memory,
        # which is gone once it exits
        blob = io.BytesIO()
        torch.save(fn(dist.group.WORLD, device, *args), blob)
        results.put((rank, blob.getvalue()))
    finally:
        dist.destroy_process_group()


# -------------------------------------------------------------------------------------------
# CUDA graphs of a sharded model


def check_capture_sizes_agree(sizes: Sequence[int], group: dist.ProcessGroup | None,
                              what: str = "CUDA-graph capture sizes") -> None:
    """ValueError on every rank unless all ranks capture the same sizes (`what`: the decode
    graphs' batch sizes or the piecewise graphs' token buckets) in the same order.

    Each captured graph holds collectives; a rank capturing a size the others skip would wait
    at replay for partners that never come (a hang, not an error). Call before capture; it
    exchanges the lists with `all_gather_object` (host objects; on NCCL the current CUDA device
    must be this rank's).
    """
    check_ranks_agree(list(sizes), group, what, "sizes")


def check_ranks_agree(value: Any, group: dist.ProcessGroup | None, what: str, fix: str) -> None:
    """ValueError on every rank unless all ranks hold an equal `value` (`what` it is; the error
    says to pass the same `fix` on all). Exchanged with `all_gather_object`: a collective."""
    gathered = _gathered(value, group)
    if gathered is not None and any(v != gathered[0] for v in gathered):
        per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(gathered))
        raise ValueError(f"ranks disagree on the {what} ({per_rank}); pass the same {fix} on all")


def failed_on_any_rank(failed: dict[str, str], group: dist.ProcessGroup | None) -> dict[str, str]:
    """Batch 1's candidate compiles that failed on any rank, each with its error (another rank's
    named as such), the same names on every rank: every rank must capture and replay the same
    candidates, since each graph holds collectives that pair with the other ranks'. Without a
    group, or on one rank, `failed` itself."""
    gathered = _gathered(failed, group)
    if gathered is None:
        return failed
    merged = dict(failed)
    for rank, errors in enumerate(gathered):
        for name, error in errors.items():
            merged.setdefault(name, f"failed on rank {rank}: {error}")
    return merged


def slowest_rank_ms(replay_ms: dict[str, float], group: dist.ProcessGroup | None) -> dict[str, float]:
    """Each candidate's replay time on the rank where it is slowest. A step of a sharded model
    waits at each collective for the slowest rank, so this is what a candidate costs the group;
    every rank gets the same dict, so a pick from it is the same on every rank. The ranks must
    have timed the same candidates (`failed_on_any_rank`); RuntimeError on every rank if not.
    Without a group, or on one rank, `replay_ms` itself."""
    gathered = _gathered(replay_ms, group)
    if gathered is None:
        return replay_ms
    if any(ms.keys() != gathered[0].keys() for ms in gathered):
        per_rank = ", ".join(f"rank {r}: {sorted(ms)}" for r, ms in enumerate(gathered))
        raise RuntimeError(f"the ranks timed different batch-1 compiles ({per_rank})")
    return {name: max(ms[name] for ms in gathered) for name in gathered[0]}


def _gathered(obj: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's `obj`, by rank (`all_gather_object`: host objects; on NCCL the current CUDA
    device must be this rank's); None without a group or with one rank (nothing to agree on)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def capture_sharded(runner: Any, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """`runner.capture()` for a sharded model: checks first that every rank captures the same
    sizes, table widths and piecewise buckets (largest first, so the graphs' collectives line up), then
    captures, every rank keeping the same batch-1 compile (`slowest_rank_ms`); returns its stats.

    runner: a `compiled_attn.graphs.CUDAGraphRunner` over this rank's model and KV caches.
    """
    check_capture_sizes_agree(runner.sizes, group)
    check_capture_sizes_agree(runner.widths if runner.sizes else [], group, "decode graphs' block-table widths")
    check_capture_sizes_agree([] if runner.piecewise is None else runner.piecewise.sizes, group, "piecewise buckets")
    return runner.capture(group=group)

"""Timing helpers every suite shares: CUDA-graph replay timing, nominal bandwidths, the card."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# Nominal HBM bandwidth by card name fragment (bytes/s); fractions in reports are of these.
NOMINAL_HBM_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.04e12}


def card_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def nominal_bandwidth() -> float | None:
    name = card_name()
    return next((bw for key, bw in NOMINAL_HBM_BW.items() if key in name), None)


def calls_graph(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back `fn()` calls, warmed up on a side stream first (JIT,
    autotune, allocator happen outside the capture), replayed once and synchronized."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_time_us(fn: Callable[[], object], *, replays: int = 50, graph_iters: int = 10) -> float:
    """Median time of one `fn()` in microseconds, captured in a CUDA graph (launch gaps gone).

    The graph holds `graph_iters` back-to-back calls (`calls_graph`); each replay is timed with events.
    """
    graph = calls_graph(fn, graph_iters)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / graph_iters)
    return statistics.median(times)


def eager_time_us(fn: Callable[[], object], *, iters: int = 50, host_only: bool = False,
                  launch_only: bool = False) -> float:
    """Median wall time of one eager `fn()` in microseconds, synchronizing on CUDA after each
    call unless `host_only` (`fn` queues no GPU work: the synchronize alone costs microseconds).
    `launch_only`: the call's host time alone, from its start on an idle GPU to its return (the
    synchronize after it is left out of the timing): what the call costs the host, without the
    GPU time and the synchronize's jitter that the full timing carries."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and not host_only else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if launch_only:
            times.append((time.perf_counter() - t0) * 1e6)
        sync()
        if not launch_only:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def pipelined_host_us(fn: Callable[[], object], *, calls: int = 100) -> float:
    """Host time of one `fn()` in microseconds, as a loop pays it: `calls` back-to-back calls
    timed together, nothing synchronized between them (the GPU, if any, runs behind; the
    synchronize after the batch is left out). A small kernel's launch queue never fills within a
    batch, so the figure is the host's work alone, without the per-call synchronize that puts a
    GPU wait and its jitter into `eager_time_us`."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e6

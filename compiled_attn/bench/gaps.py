"""Where a profiled step's GPU sits idle, from a `torch.profiler` chrome trace.

Issue 14's goal is a step's wall time over its summed kernel time; the difference is idle GPU
time. Each step is a `record_function("step N")` range that ends in a synchronize. Its idle time
is the lead (range start to its first device event), the gaps between its device events, and the
tail (the last event's end to the range's end). The part of a gap that is *host-bound* is the time
the runtime call launching the next event was still running after the GPU had finished the work
before it (the GPU waited for the host); the rest is the GPU's own latency in starting the next
event (between a graph and a kernel, say). Gaps are keyed by the events on each side: "graph"
for a kernel a `cudaGraphLaunch` launched ("graph, same launch" when both sides are one replay's),
else the kernel's name.
"""

from __future__ import annotations

from collections import defaultdict

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
NAME_WIDTH = 72  # FlashInfer's prefill and tensor-core decode kernels differ past 48 characters


def gap_table(events: list[dict], prefix: str = "step ") -> dict:
    """rows (per pair of sides, most idle first): gaps and idle us per step, and the host-bound
    part; totals per step: wall, busy (summed device time), lead, gaps and tail."""
    spans = [e for e in events if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e for e in spans
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    device = sorted((e for e in spans if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    steps = sorted((e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith(prefix)),
                   key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"no user_annotation ranges named {prefix!r}...: wrap each step in record_function")

    def launch_of(e: dict) -> dict | None:
        return launches.get(e.get("args", {}).get("correlation"))

    def side(e: dict, before: dict | None = None) -> str:
        launch = launch_of(e)
        if launch is not None and launch["name"] == "cudaGraphLaunch":
            same = before is not None and launch_of(before) is launch
            return "graph, same launch" if same else "graph"
        return e["name"] if len(e["name"]) <= NAME_WIDTH else e["name"][: NAME_WIDTH - 3] + "..."

    gaps: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # count, us, host-bound us
    totals = dict.fromkeys(("wall", "busy", "lead", "gaps", "tail"), 0.0)
    for step in steps:
        begin, end = step["ts"], step["ts"] + step["dur"]
        mine = [e for e in device if begin <= e["ts"] < end]
        if not mine:
            raise ValueError(f"{step['name']!r} has no device events (profiled without CUDA activity?)")
        totals["wall"] += end - begin
        totals["lead"] += mine[0]["ts"] - begin
        last, done, idle = mine[0], mine[0]["ts"] + mine[0]["dur"], 0.0
        for e in mine[1:]:
            gap = e["ts"] - done
            if gap > 0:
                launch = launch_of(e)
                waited = 0.0 if launch is None else min(gap, max(0.0, launch["ts"] + launch["dur"] - done))
                entry = gaps[(side(last), side(e, last))]
                entry[0] += 1
                entry[1] += gap
                entry[2] += waited
                idle += gap
            if e["ts"] + e["dur"] > done:
                last, done = e, e["ts"] + e["dur"]
        # busy: the device events' union (overlapping ones counted once), so that lead + gaps +
        # tail + busy is the wall time; an event past the range's end (no synchronize) counts to it
        totals["gaps"] += idle
        totals["busy"] += done - mine[0]["ts"] - idle
        totals["tail"] += max(0.0, end - done)
    n = len(steps)
    rows = [{"from": a, "to": b, "gaps/step": c / n, "us/step": us / n, "host-bound us/step": host / n}
            for (a, b), (c, us, host) in gaps.items()]
    rows.sort(key=lambda r: -r["us/step"])
    return {"rows": rows, "steps": n, **{f"{k} us/step": v / n for k, v in totals.items()}}


def markdown(table: dict, title: str, top: int = 12) -> str:
    """The totals, then the `top` pairs of sides by idle time."""
    lines = [f"**{title}** ({table['steps']} steps): wall {table['wall us/step']:.0f} us / step, device busy "
             f"{table['busy us/step']:.0f}; idle: lead {table['lead us/step']:.0f}, gaps {table['gaps us/step']:.0f}, "
             f"tail {table['tail us/step']:.0f}", "",
             "| from | to | gaps / step | idle us / step | host-bound us / step |", "|---|---|---|---|---|"]
    for r in table["rows"][:top]:
        lines.append(f"| `{r['from']}` | `{r['to']}` | {r['gaps/step']:.1f} | {r['us/step']:.1f} | "
                     f"{r['host-bound us/step']:.1f} |")
    return "\n".join(lines)


def host_during_gaps(events: list[dict], step: int = 0, min_gap_us: float = 20.0, per_gap: int = 10,
                     prefix: str = "step ") -> list[str]:
    """A diagnostic for traces taken with `with_stack=True`: per gap of at least `min_gap_us`
    before a device event of step `step`, the Python functions that ran over at least a quarter
    of it and took at most 4x as long (the frames that explain it, not the step's outer ones)."""
    spans = [e for e in events if e.get("ph") == "X"]
    ranges = sorted((e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith(prefix)),
                    key=lambda e: e["ts"])
    begin = ranges[step]["ts"]
    end = begin + ranges[step]["dur"]
    device = sorted((e for e in spans if e.get("cat") in DEVICE_CATEGORIES and begin <= e["ts"] < end),
                    key=lambda e: e["ts"])
    python = [e for e in spans if e.get("cat") == "python_function" and begin <= e["ts"] < end]
    lines, done = [], begin
    for e in device:
        gap = e["ts"] - done
        if gap >= min_gap_us:
            lines.append(f"+{done - begin:.0f} us: {gap:.0f} us idle before {e['name'][:60]}")
            frames = [f for f in python if f["dur"] <= 4 * gap
                      and min(f["ts"] + f["dur"], e["ts"]) - max(f["ts"], done) >= gap / 4]
            for f in sorted(frames, key=lambda f: f["ts"])[:per_gap]:
                lines.append(f"    +{f['ts'] - begin:.0f} {f['dur']:.0f} us {f['name'][:100]}")
        done = max(done, e["ts"] + e["dur"])
    return lines

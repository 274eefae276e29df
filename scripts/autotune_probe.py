"""Which Triton kernels Inductor tunes again in a process whose caches are warm, and why.

A warm `bench --quick` on an H100 (torch 2.11, every graph an FX-cache hit) still spent 30 s of
decode_loop and 23 s of piecewise_bench in Inductor's runtime tuning (`autotune s`). This runs
`python -m compiled_attn bench --quick --suite SUITE` twice with one fresh Inductor/Triton cache
(a cold process, then a warm one), recording every runtime tuning: the kernel, its heuristic,
its number of configs, what the autotune cache said when the kernel was loaded
(`autotune_cache_info`), whether its launcher's config came from coordinate descent, and the
seconds. It prints, for the warm process, the kernels tuned again, grouped by cache state.

    python3 scripts/autotune_probe.py --suite decode_loop --out "$OUT"   # on the device, ~5 min

`--torch-recheck` leaves torch's own `recheck_autotune_cache` in place (the library installs
`inductor_cache.keep_tuned_configs` on torch 2.11: PyTorch issue 172819); `--static-launcher 0`
runs both processes with Inductor's static CUDA launcher off.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run in each child before the bench: wrap the two runtime-tuning entry points of Inductor's
# CachingAutotuner so that each call appends one JSON line to $PROBE_LOG.
HOOKS = r"""
import json, os, sys, time
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

def record(kind, self, seconds):
    launchers = getattr(self, "launchers", None) or [None]
    config = getattr(launchers[0], "config", None)
    row = {"kind": kind, "kernel": self.inductor_meta.get("kernel_name") or self.fn.__name__,
           "heuristic": str(self.heuristic_type), "configs": len(self.configs),
           "cache": {k: str(v) for k, v in (getattr(self, "autotune_cache_info", None) or {}).items()},
           "found_by_coordesc": bool(getattr(config, "found_by_coordesc", False)),
           "static": type(self.compile_results[0]).__name__ if getattr(self, "compile_results", None) else None,
           "seconds": round(seconds, 3)}
    with open(os.environ["PROBE_LOG"], "a") as f:
        f.write(json.dumps(row) + "\n")

def wrap(name):
    inner = getattr(CachingAutotuner, name)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            record(name, self, time.perf_counter() - start)
    setattr(CachingAutotuner, name, timed)

for name in ("benchmark_all_configs", "_coordinate_descent_tuning"):
    wrap(name)
if os.environ.get("PROBE_TORCH_RECHECK") == "1":  # keep_tuned_configs then installs torch's own
    import compiled_attn.inductor_cache as inductor_cache
    inductor_cache.recheck_autotune_cache = CachingAutotuner.recheck_autotune_cache
from compiled_attn.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def run_bench(suite: str, cache: Path, log: Path, out: Path, static: str | None, torch_recheck: bool) -> float:
    """One bench process on `cache`, its tunings appended to `log`; returns its wall seconds."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton"),
           "PROBE_LOG": str(log), "PROBE_TORCH_RECHECK": "1" if torch_recheck else "0"}
    if static is not None:
        env["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] = static
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", HOOKS, "bench", "--quick", "--suite", suite, "--out", str(out)],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def summary(log: Path) -> str:
    """The tunings in `log`: count and seconds, then by (kind, cache state, static, coordesc)."""
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for row in rows:
        key = (row["kind"], row["cache"].get("autotune_cache_state", "none"), row["static"], row["heuristic"],
               f"configs={row['configs']}")
        groups[key].append(row)
    lines = [f"{len(rows)} tunings, {sum(r['seconds'] for r in rows):.1f} s"]
    for key, members in sorted(groups.items(), key=lambda kv: -sum(r["seconds"] for r in kv[1])):
        names = sorted({r["kernel"] for r in members})
        lines.append(f"  {sum(r['seconds'] for r in members):6.1f} s  {len(members):4d} x  {' | '.join(key)}"
                     f"  e.g. {', '.join(names[:3])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="decode_loop")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--static-launcher", choices=("0", "1"), default=None,
                        help="TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER for both processes (default: torch's)")
    parser.add_argument("--torch-recheck", action="store_true", help="without keep_tuned_configs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="autotune-probe-"))
    for phase in ("cold", "warm"):
        log = args.out / f"autotune-{phase}.jsonl"
        seconds = run_bench(args.suite, cache, log, Path(tempfile.mkdtemp()), args.static_launcher,
                            args.torch_recheck)
        print(f"== {phase} process: {seconds:.0f} s; {summary(log)}", flush=True)


if __name__ == "__main__":
    main()

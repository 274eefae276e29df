"""`python -m compiled_attn demo | bench`: the demo (main job) and the benchmark suites."""

from __future__ import annotations

import argparse
import os
import sys


def print_table(rows: list[dict], keys: list[str] | None = None) -> None:
    """Rows of dicts as an aligned text table (floats to 4 significant digits); columns: every
    key of any row, in order of first appearance (ceiling rows carry GB/s or TFLOP/s)."""
    if not rows:
        return
    keys = keys or list(dict.fromkeys(k for r in rows for k in r))
    cells = [[f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, refused when the arguments are parsed rather than after a run."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def output_dir(text: str) -> str:
    """argparse type: a folder the results can be written to, made now: a bad --out fails before
    the run, not after it."""
    try:
        os.makedirs(text, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot make folder {text!r}: {e.strerror or e}") from None
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"folder {text!r} is not writable")
    return text


def backend_name(text: str) -> str:
    """argparse type: a backend name (any case), checked against the registry's names."""
    from compiled_attn.registry import BACKEND_PATHS

    if text.upper() not in BACKEND_PATHS:
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; choose one of {list(BACKEND_PATHS)}")
    return text.upper()


def main(argv: list[str] | None = None) -> int:
    from compiled_attn.bench.suite import SUITES

    parser = argparse.ArgumentParser(prog="python -m compiled_attn")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve the reference model eagerly and compiled, and compare")
    demo.add_argument("--backend", type=backend_name, default=None,
                      help="TORCH_SDPA | FLASHINFER | XFORMERS (default: best here)")
    demo.add_argument("--steps", type=positive_int, default=16)
    demo.add_argument("--tp", type=positive_int, default=1,
                      help="shard the model over N processes (N GPUs with NCCL if there are N, else CPU with gloo)")
    bench = sub.add_parser("bench", help="benchmark suites (see BENCHMARKS.md)")
    bench.add_argument("--backend", type=backend_name, action="append", default=None,
                       help="repeat to select several")
    bench.add_argument("--quick", action="store_true")
    bench.add_argument("--suite", action="append", default=None, choices=[m.rsplit(".", 1)[1] for m, _, _ in SUITES],
                       help="run only these suites (repeat to select several)")
    bench.add_argument("--out", type=output_dir, default=".", help="folder for bench-results.json and plots")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from compiled_attn.demo import check_demo_args, run_demo

        try:  # everything the run would trip over later, before it starts
            check_demo_args(steps=args.steps, backend_name=args.backend)
        except (ValueError, RuntimeError, NotImplementedError) as e:
            parser.error(str(e))
        row = run_demo(steps=args.steps, backend_name=args.backend, tp=args.tp)
        print_table([row], [k for k in row if k != "agree"])
        best = "graphs tok/s" if "graphs tok/s" in row else "compiled tok/s"
        print(
            f"summary: {row['backend']} on {row['device']} (tp={row['tp']}): {row[best]:.1f} tok/s "
            f"{best.removesuffix(' tok/s')}, {row[best] / row['eager tok/s']:.2f}x eager; {row['check']}"
        )
        return 0 if row["agree"] else 1
    from compiled_attn.bench.suite import run_bench

    return run_bench(backends=args.backend, quick=args.quick, out=args.out, suites=args.suite)


if __name__ == "__main__":
    sys.exit(main())

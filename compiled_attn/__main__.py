"""`python -m compiled_attn demo | bench`: the demo (main job) and the benchmark suites."""

from __future__ import annotations

import argparse
import sys

from compiled_attn import demo
from compiled_attn.bench import suite
from compiled_attn.bench.report import print_table
from compiled_attn.cli import backend_name, output_dir, positive_int
from compiled_attn.registry import BACKEND_CLASSES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compiled_attn")
    sub = parser.add_subparsers(dest="command", required=True)
    demo_args = sub.add_parser("demo", help="serve the reference model eagerly and compiled, and compare")
    demo_args.add_argument("--backend", type=backend_name, default=None,
                      help=f"{' | '.join(BACKEND_CLASSES())} (default: best here)")
    demo_args.add_argument("--steps", type=positive_int, default=16)
    demo_args.add_argument("--tp", type=positive_int, default=1,
                      help="shard the model over N processes (N GPUs with NCCL if there are N, else CPU with gloo)")
    bench_args = sub.add_parser("bench", help="benchmark suites (see BENCHMARKS.md)")
    bench_args.add_argument("--backend", type=backend_name, action="append", default=None,
                       help="repeat to select several")
    bench_args.add_argument("--quick", action="store_true")
    bench_args.add_argument("--suite", action="append", default=None, choices=suite.suite_names(),
                       help="run only these suites (repeat to select several)")
    bench_args.add_argument("--out", type=output_dir, default=".", help="folder for bench-results.json and plots")
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:  # everything the run would trip over later, before it starts
            demo.check_demo_args(steps=args.steps, backend_name=args.backend)
        except (ValueError, RuntimeError, NotImplementedError) as e:
            parser.error(str(e))
        row = demo.run_demo(steps=args.steps, backend_name=args.backend, tp=args.tp)
        print_table([row], [k for k in row if k != "agree"])
        best = "graphs tok/s" if "graphs tok/s" in row else "compiled tok/s"
        print(
            f"summary: {row['backend']} on {row['device']} (tp={row['tp']}): {row[best]:.1f} tok/s "
            f"{best.removesuffix(' tok/s')}, {row[best] / row['eager tok/s']:.2f}x eager; {row['check']}"
        )
        return 0 if row["agree"] else 1
    return suite.run_bench(backends=args.backend, quick=args.quick, out=args.out, suites=args.suite)


if __name__ == "__main__":
    sys.exit(main())

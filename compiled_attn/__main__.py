"""`python -m compiled_attn demo | bench | generate`: the demo (main job), the benchmark suites and
serving a transformers model (optional extra [transformers])."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from compiled_attn import demo
from compiled_attn.base import ENV_VAR
from compiled_attn.bench import suite
from compiled_attn.bench.report import print_table
from compiled_attn.capabilities import smallest_block_size
from compiled_attn.cli import backend_name, output_dir, positive_int
from compiled_attn.integrations.generate import prompt_ids_problem, run_generate
from compiled_attn.integrations.hf_random import FAMILIES, SIZES
from compiled_attn.registry import BACKEND_CLASSES, get_attn_backend


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
                       help="skip the suites of other backends (repeat to select several); suites over every "
                            "backend still measure each one available")
    bench_args.add_argument("--quick", action="store_true")
    bench_args.add_argument("--suite", action="append", default=None, choices=suite.suite_names(),
                       help="run only these suites (repeat to select several)")
    bench_args.add_argument("--out", type=output_dir, default=".", help="folder for bench-results.json and plots")
    gen_args = sub.add_parser("generate", help="serve a transformers model (local folder or random weights)")
    source = gen_args.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=model_dir, help="a local transformers model folder (from_pretrained)")
    source.add_argument("--random", choices=FAMILIES,
                        help="random weights of this family (no download)")
    gen_args.add_argument("--size", choices=tuple(SIZES), default="small",
                          help="shape of the --random model")
    gen_args.add_argument("--prompt", action="append", default=None, help="a prompt text (needs --model's tokenizer)")
    gen_args.add_argument("--num-prompts", type=positive_int, default=8, help="random prompts (without --prompt)")
    gen_args.add_argument("--prompt-len", type=positive_int, default=64)
    gen_args.add_argument("--max-new-tokens", type=positive_int, default=64)
    gen_args.add_argument("--backend", type=backend_name, default=None)
    gen_args.add_argument("--block-size", type=positive_int, default=16)
    gen_args.add_argument("--no-compile", action="store_true")
    gen_args.add_argument("--no-cuda-graphs", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "generate":
        if args.prompt and args.random:
            parser.error("--prompt needs --model's tokenizer: with --random, use --num-prompts / --prompt-len")
        # before the model is loaded (without transformers, _generate says what to install)
        problem = args.prompt and importlib.util.find_spec("transformers") and prompt_ids_problem(args.model,
                                                                                                   args.prompt)
        if problem:
            parser.error(problem)
        if args.backend is not None or os.environ.get(ENV_VAR):  # the engine would pick $COMPILED_ATTN_BACKEND's
            try:  # before the model is built: the backend's package, device and block sizes
                chosen = get_attn_backend(args.backend)
            except (ValueError, RuntimeError, NotImplementedError) as e:
                parser.error(str(e))
            if not chosen.supports_block_size(args.block_size):
                parser.error(f"{chosen.get_name()} cannot serve --block-size {args.block_size}: use "
                             f"--block-size {smallest_block_size(chosen, args.block_size)}")
        return _generate(args)
    if args.command == "demo":
        try:  # everything the run would trip over later, before it starts
            demo.check_demo_args(steps=args.steps, backend_name=args.backend, tp=args.tp)
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
    if not suite.chosen_suites(args.backend, args.suite):
        parser.error(f"no suite to run here for --suite {args.suite or 'all'} and --backend {args.backend or 'any'} "
                     "(some suites need CUDA, some one backend): choose others")
    return suite.run_bench(backends=args.backend, quick=args.quick, out=args.out, suites=args.suite)


def model_dir(text: str) -> str:
    """A local folder holding a transformers config (no hub access here)."""
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder with a config.json")
    return text


def _generate(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401  (the optional extra this command needs)
    except ImportError:
        print("generate needs transformers: pip install 'compiled_attn[transformers]'", file=sys.stderr)
        return 2
    row = run_generate(model_dir=args.model, family=args.random, size=args.size, prompts=args.prompt,
                       num_prompts=args.num_prompts, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
                       backend=args.backend, block_size=args.block_size, compile=not args.no_compile,
                       cuda_graphs=not args.no_cuda_graphs)
    outputs = row.pop("texts", None) or row.pop("token ids", None)
    print_table([row], list(row))
    for i, output in enumerate(outputs or []):
        print(f"[{i}] {output}")
    steady = "" if row["steady tok/s"] is None else f", {row['steady tok/s']:.1f} tok/s after the first step"
    print(f"summary: {row['new tokens']} tokens in {row['seconds']:.2f} s = {row['tok/s']:.1f} tok/s{steady} "
          f"({row['backend']} on {row['device']}; groups {row['groups']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How Inductor's tuning settings move our decode loop: fresh compiles of ours (the runner's
`compile=True`) at one point, per set of Inductor options added to `runner.COMPILE_OPTIONS`.

    python scripts/tuning_probe.py --point 1x1024 --draws 2 \
        --set "" --set "coordinate_descent_search_radius=2,coordinate_descent_check_all_directions=True"

At batch 1 the matrix-vector products are Inductor reductions tuned by coordinate descent, and a
draw decides the step (4.4 to 6.0 ms on an H200 across processes): each set gets `--draws`
compiles with Inductor's caches off, so every draw tunes afresh. One JSON row per set, with each
draw's ms / step; `--peer-draws N` adds the gpt-fast peer's best of N in the same process.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch

from compiled_attn.bench import decode_loop as dl
from compiled_attn.cli import inductor_option, point
from compiled_attn.graphs import runner


def option_set(text: str) -> dict[str, object]:
    """"k=v,k=v" (each `cli.inductor_option`); "" is the runner's own options."""
    return dict(inductor_option(item) for item in filter(None, text.split(",")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--point", type=point, required=True, metavar="BxCTX")
    parser.add_argument("--draws", type=int, default=2)
    parser.add_argument("--set", type=option_set, action="append", required=True, dest="sets")
    parser.add_argument("--peer-draws", type=int, default=0)
    parser.add_argument("--backend", default="FLASHINFER")
    args = parser.parse_args(argv)
    batch, ctx = args.point
    model = dl.build_8b(args.backend)
    if args.peer_draws:
        row = dl.measure_peer(model, batch, ctx, args.peer_draws)
        print(json.dumps({**row, "options": "gpt-fast's"}), flush=True)
    with torch._inductor.config.patch(force_disable_caches=True):
        for options in args.sets:
            with mock.patch.dict(runner.COMPILE_OPTIONS, options):
                row = dl.measure_ours(model, batch, ctx, compiles=args.draws)
            row["options"] = {**runner.COMPILE_OPTIONS, **options}
            print(json.dumps(row, default=str), flush=True)


if __name__ == "__main__":
    main()

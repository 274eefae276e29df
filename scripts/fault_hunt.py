"""Find the first differential example that breaks a backend on the GPU, and keep it.

A CUDA fault (illegal address) surfaces at the next synchronizing call, which under pytest is
often the *next* Hypothesis example, and it poisons every example after it, so the shrunk case
pytest reports is rarely the culprit. This runs the differential strategy deterministically,
synchronizes after every example, and writes the example that raised to `$OUT/culprit.json`
(and the one before it to `$OUT/previous.json`); mismatches are printed and the hunt goes on.

    python scripts/fault_hunt.py XFORMERS [--examples 300]     # hunt
    python scripts/fault_hunt.py XFORMERS --replay culprit.json # one case (e.g. under compute-sanitizer)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, settings

sys.path[:0] = [str(Path(__file__).parent.parent / "tests")]
from test_differential import DEVICE_LIMITS, Case, cases, check_against_reference  # noqa: E402

from compiled_attn.cli import positive_int  # noqa: E402
from compiled_attn.registry import BACKEND_CLASSES  # noqa: E402


def hunt(backend: type, device: str, examples: int, out: Path) -> int:
    """Mismatches seen; raises the first non-assertion error after saving its case."""
    current, previous = out / "current.json", out / "previous.json"
    mismatches = 0

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    @given(case=cases(backend, device, DEVICE_LIMITS))
    def run(case: Case) -> None:
        nonlocal mismatches
        if current.exists():
            current.replace(previous)
        current.write_text(case.to_json(backend.get_name(), device))
        try:
            check_against_reference(case, backend, device)
            sync(device)
        except AssertionError as e:
            mismatches += 1
            print(f"mismatch: {str(e).splitlines()[0]}\n  {current.read_text()}", flush=True)
        except Exception:
            current.replace(out / "culprit.json")
            print(f"FAULT: {case}", flush=True)
            raise

    run()
    return mismatches


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=sorted(BACKEND_CLASSES()))
    parser.add_argument("--examples", type=positive_int, default=300)
    parser.add_argument("--device", default="cuda", help="cpu runs TORCH_SDPA's hunt (to try the script)")
    parser.add_argument("--replay", help="a case JSON written by a hunt")
    args = parser.parse_args()
    backend = BACKEND_CLASSES()[args.backend]
    if args.replay:
        case = Case.from_dict(json.loads(Path(args.replay).read_text())["case"])
        check_against_reference(case, backend, args.device)
        sync(args.device)
        print("replay passed")
        return
    out = Path(os.environ.get("OUT", "."))
    print(f"{hunt(backend, args.device, args.examples, out)} mismatches in {args.examples} examples, no fault")


if __name__ == "__main__":
    main()

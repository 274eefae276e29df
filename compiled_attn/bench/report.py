"""The result tables every suite, the CLI and the scripts print."""

from __future__ import annotations


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

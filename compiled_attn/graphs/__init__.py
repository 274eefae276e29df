"""CUDA graphs: `CUDAGraphRunner` (full decode graphs, piecewise graphs for the other steps) and
its bucketing decisions."""

from compiled_attn.graphs.buckets import (
    DEFAULT_CAPTURE_SIZES,
    DEFAULT_PIECEWISE_SIZES,
    capture_sizes_for,
    choose_path,
    pick_batch_size,
    pick_table_width,
)
from compiled_attn.graphs.runner import CUDAGraphRunner, token_positions

__all__ = ["DEFAULT_CAPTURE_SIZES", "DEFAULT_PIECEWISE_SIZES", "CUDAGraphRunner", "capture_sizes_for", "choose_path",
           "pick_batch_size", "pick_table_width", "token_positions"]

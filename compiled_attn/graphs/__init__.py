"""CUDA graphs for decode steps: `CUDAGraphRunner` and its bucketing decisions."""

from compiled_attn.graphs.buckets import (
    DEFAULT_CAPTURE_SIZES,
    capture_sizes_for,
    choose_path,
    pick_batch_size,
    pick_table_width,
)
from compiled_attn.graphs.runner import CUDAGraphRunner

__all__ = ["DEFAULT_CAPTURE_SIZES", "CUDAGraphRunner", "capture_sizes_for", "choose_path", "pick_batch_size",
           "pick_table_width"]

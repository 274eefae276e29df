"""The one built model the suites of a bench process share.

e2e, decode_loop and piecewise_bench each time the 8B shape with seed-0 weights on the same
backend; drawing 8 G random weights and allocating 16 GB once instead of per suite keeps the
`--quick` run short. One model at a time: a second 8B model would crowd out the KV caches.
"""

from __future__ import annotations

import torch

from compiled_attn.models.llama import Llama, LlamaConfig, build_model

_built: dict[tuple[LlamaConfig, str, str], Llama] = {}


def shared_model(config: LlamaConfig, backend: str, kv_cache_dtype: str = "auto") -> Llama:
    """The bf16 CUDA model of `config` for `backend`, seed-0 weights drawn on the device; built on
    first request, the previously shared model dropped first (speed does not care about values)."""
    key = (config, backend, kv_cache_dtype)
    if key not in _built:
        _built.clear()
        torch.cuda.empty_cache()
        _built[key] = build_model(config, seed=0, backend=backend, dtype=torch.bfloat16, device="cuda",
                                  init_device="cuda", kv_cache_dtype=kv_cache_dtype)
    return _built[key]

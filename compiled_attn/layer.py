"""`Attention`: the nn.Module a model holds; it picks its backend's impl and owns no cache."""

from __future__ import annotations

import os

import torch
from torch import nn

from compiled_attn.abstract import AttentionSpec, AttentionType
from compiled_attn.registry import ENV_VAR, get_attn_backend
from compiled_attn.validation import as_attn_type, check_impl_args


class Attention(nn.Module):
    """Paged attention for one layer, traceable with `torch.compile(fullgraph=True)`.

    The model passes tensors only; the step's metadata comes from `set_forward_context`.

    Args: as `AttentionImpl`, plus `attn_type`, `backend` (name or None for auto), the fp8
    cache scales `k_scale` / `v_scale` (K/V are divided by them when stored) and `group`: the
    layer group whose metadata this layer reads when the forward context holds one per group
    (`compiled_attn.groups.GroupedMetadata`); None for a model with one group.

    Shapes: query [num_tokens, num_heads * head_size]; key/value [num_tokens, num_kv_heads *
    head_size] (or None for cross attention after the encoder step); kv_cache [2, num_blocks,
    block_size, num_kv_heads, head_size]. Returns [num_tokens, num_heads * head_size].

    Example::

        layer = ca.Attention(32, 128, 128**-0.5, num_kv_heads=8, backend="TORCH_SDPA")
        with ca.set_forward_context(md):
            out = layer(q, k, v, kv_cache)
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | torch.Tensor | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: AttentionType = AttentionType.DECODER,
        backend: str | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        group: str | None = None,
    ) -> None:
        super().__init__()
        # checked here first, so that a bad argument is named as the layer's (not a probe spec's)
        args = check_impl_args(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                               kv_cache_dtype, logits_soft_cap)
        attn_type = as_attn_type(attn_type)
        if backend is None and not os.environ.get(ENV_VAR):
            # pick by what this layer needs (heads, head size, features, attention type); the
            # model's dtype is not known here: bf16 on CUDA, fp32 on CPU is assumed
            cuda = torch.cuda.is_available()
            probe = AttentionSpec(
                **{k: args[k] for k in ("num_heads", "num_kv_heads", "head_size", "kv_cache_dtype", "scale",
                                        "sliding_window", "logits_soft_cap", "alibi_slopes")},
                block_size=64, num_blocks=1, dtype=torch.bfloat16 if cuda else torch.float32,
                device="cuda" if cuda else "cpu", attn_type=attn_type,
            )
            self.backend = get_attn_backend(None, probe)
        else:
            self.backend = get_attn_backend(backend)
        self.impl = self.backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            kv_cache_dtype, logits_soft_cap,
        )
        self.attn_type = attn_type
        # the ops find k/v scales, scale, window, soft-cap and ALiBi through this name (a string
        # is a constant to Dynamo; floats would become symbolic graph inputs under dynamic=True)
        self.layer_name, self._call = self.impl.register(k_scale, v_scale, self.attn_type, group)
        self.group = group

    def __setstate__(self, state: dict) -> None:
        # a copy (copy.deepcopy, pickle) carries its original's layer name, which the ops resolve
        # to the original's options, or to whatever layer takes the name once the original dies
        super().__setstate__(state)
        call = self._call
        self.layer_name, self._call = self.impl.register(call.k_scale, call.v_scale, self.attn_type, self.group)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        return self.impl.run(query, key, value, kv_cache, self.attn_type, self.layer_name)

    def extra_repr(self) -> str:
        impl = self.impl
        return (
            f"backend={self.backend.get_name()}, num_heads={impl.num_heads}, "
            f"num_kv_heads={impl.num_kv_heads}, head_size={impl.head_size}, attn_type={self.attn_type.name}"
            + ("" if self.group is None else f", group={self.group!r}")
        )

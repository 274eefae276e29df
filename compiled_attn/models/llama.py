"""A small Llama-style decoder on `ca.Attention`: the reference user of the compiled path.

RMSNorm, rotary embeddings, SwiGLU and GQA, random weights from a seed. The model is plain eager
PyTorch; `torch.compile` is applied by the caller at one call site. It takes a flat batch of
tokens (prefills first, then decodes) and never sees attention metadata as an argument.

Given a process group, the model is sharded Megatron-style over its ranks (see models/tp.py);
without one (or with a 1-rank group) it is the plain single-device model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import compiled_attn as ca
from compiled_attn.distributed import check_ranks_agree
from compiled_attn.models import tp as tpm
from compiled_attn.validation import as_int


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 2
    rope_theta: float = 500000.0
    max_position: int = 8192
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position"):
            as_int(f"LlamaConfig.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: hidden_size={self.hidden_size} must split into num_heads={self.num_heads}"
                             f" heads, and those into num_kv_heads={self.num_kv_heads} groups of equal size")
        if self.head_size % 2:
            raise ValueError(f"LlamaConfig: the head size hidden_size / num_heads = {self.head_size} must be even "
                             "(rotary embedding turns pairs of features)")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def llama3_8b(cls) -> LlamaConfig:
        """Llama-3-8B's shapes (random weights): the end-to-end benchmark model."""
        return cls(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                   num_heads=32, num_kv_heads=8)

    def attention_spec(self, *, block_size: int, num_blocks: int, dtype: torch.dtype,
                       device: str | torch.device, tp_size: int = 1, **kw: object) -> ca.AttentionSpec:
        """The spec all decoder layers of this model share; with `tp_size` ranks, one rank's
        (its local num_heads and num_kv_heads, see `tp.local_head_counts`)."""
        num_heads, num_kv_heads = tpm.local_head_counts(self.num_heads, self.num_kv_heads, tp_size)
        return ca.AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_size=self.head_size, block_size=block_size, num_blocks=num_blocks,
                                dtype=dtype, device=device, **kw)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32: bf16 sums of squares lose the small components
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary_tables(head_size: int, max_position: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [max_position, head_size // 2] in fp32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_size] rotated by per-token cos/sin [num_tokens, head_size // 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    """One block; on a tensor-parallel rank it holds its heads and MLP columns (sizes below are local)."""

    def __init__(self, config: LlamaConfig, backend: str | None, tp: tpm.TPLayout = tpm.NO_TP,
                 kv_cache_dtype: str = "auto") -> None:
        super().__init__()
        h, d, inter = config.hidden_size, config.head_size, config.intermediate_size
        num_heads, num_kv_heads = tpm.local_head_counts(config.num_heads, config.num_kv_heads, tp.size)
        self.q_size, self.kv_size = num_heads * d, num_kv_heads * d
        full_q, full_kv = config.num_heads * d, config.num_kv_heads * d
        q0, kv0 = tp.rank * self.q_size, tpm.first_kv_head(config.num_kv_heads, tp) * d
        local_inter = tpm.check_divisible("intermediate_size", inter, tp.size)
        i0 = tp.rank * local_inter
        self.attn_norm = RMSNorm(h, config.norm_eps)
        # one matmul for q, k, v: this rank's rows of each of the full weight's three parts
        self.qkv_proj = tpm.ColumnParallelLinear(h, full_q + 2 * full_kv, [
            (q0, q0 + self.q_size),
            (full_q + kv0, full_q + kv0 + self.kv_size),
            (full_q + full_kv + kv0, full_q + full_kv + kv0 + self.kv_size),
        ])
        self.attn = ca.Attention(num_heads, d, d**-0.5, num_kv_heads=num_kv_heads, backend=backend,
                                 kv_cache_dtype=kv_cache_dtype)
        self.o_proj = tpm.RowParallelLinear(full_q, h, tp)
        self.mlp_norm = RMSNorm(h, config.norm_eps)
        self.gate_up_proj = tpm.ColumnParallelLinear(h, 2 * inter, [
            (i0, i0 + local_inter), (inter + i0, inter + i0 + local_inter),
        ])
        self.down_proj = tpm.RowParallelLinear(inter, h, tp)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, d

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(self.attn_norm(x)).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_size), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_size), cos, sin)
        attn = self.attn(q.view(num_tokens, self.q_size), k.view(num_tokens, self.kv_size), v, kv_cache)
        x = x + self.o_proj(attn)
        gate, up = self.gate_up_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(nn.functional.silu(gate) * up)


class Llama(nn.Module):
    """input_ids, positions: int64 [num_tokens]; kv_caches: one [2, num_blocks, block_size,
    num_kv_heads, head_size] per layer (this rank's KV heads when sharded). Returns logits
    [num_tokens, vocab_size] (fp32), the full vocab on every rank (when sharded, a transposed
    view of the gathered [vocab_size, num_tokens]).

    tp_group: shard over this process group's ranks (every rank builds the model with the same
    config and feeds the same inputs and metadata); None: unsharded. kv_cache_dtype: the
    layers' cache element type ("auto" = the model dtype, "fp8" = e4m3, ...).
    """

    def __init__(self, config: LlamaConfig, backend: str | None = None,
                 tp_group: dist.ProcessGroup | None = None, kv_cache_dtype: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.tp = tp = tpm.layout_of(tp_group)
        self.embed = tpm.VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, tp, kv_cache_dtype)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = tpm.VocabParallelLMHead(config.hidden_size, config.vocab_size, tp)
        cos, sin = rotary_tables(config.head_size, config.max_position, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache)
        return self.lm_head(self.norm(x)).float()


def build_model(
    config: LlamaConfig,
    *,
    seed: int = 0,
    backend: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp_group: dist.ProcessGroup | None = None,
    init_device: str | torch.device = "cpu",
    kv_cache_dtype: str = "auto",
) -> Llama:
    """A model with random weights drawn from `seed` (std 1/sqrt(fan_in), so logits spread and
    greedy tokens are not ties). `init_device` is where the random numbers are drawn: "cuda"
    takes seconds for an 8B model where the CPU takes minutes (the draws differ by device).

    With `tp_group`, this rank's shard: every weight is drawn at its full size in the unsharded
    model's order and sliced, so all ranks together hold exactly the unsharded model of `seed`.
    The group must suit `device` (NCCL for CUDA, gloo for CPU), and every rank must pass the same
    arguments: ValueError on every rank otherwise (a collective: on NCCL the current CUDA device
    must be this rank's, as `distributed.run_ranks` sets it).
    """
    tpm.check_group_device(tp_group, device)
    # every rank must shard one model: another config would wait at a collective the others never
    # make (a hang), another seed or init device draw weights no single seed gives
    check_ranks_agree((config, seed, backend, str(dtype), str(torch.device(init_device)), kv_cache_dtype), tp_group,
                      "model (config, seed, backend, dtype, init_device, kv_cache_dtype)", "build_model arguments")
    with torch.device("meta"):
        model = Llama(config, backend, tp_group, kv_cache_dtype)
    model = model.to_empty(device=device)
    g = torch.Generator(device=init_device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = model.get_submodule(name.rpartition(".")[0])
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                full_shape = tpm.full_shape_of(owner, p)
                fan_in = full_shape[1] if p.dim() == 2 and "embed" not in name else 1
                p.copy_(tpm.shard_of(owner, torch.randn(full_shape, generator=g, device=init_device) / fan_in**0.5))
    model = model.to(dtype).requires_grad_(False)
    # rotary tables stay fp32 whatever the model dtype: positions up to 8k need the mantissa
    cos, sin = rotary_tables(config.head_size, config.max_position, config.rope_theta)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model


def allocate_kv_caches(
    config: LlamaConfig, backend: type[ca.AttentionBackend], spec: ca.AttentionSpec
) -> list[torch.Tensor]:
    """One cache per layer, from torch.empty like a real server (unused slots hold garbage)."""
    shape = backend.get_kv_cache_shape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return [torch.empty(shape, dtype=spec.cache_dtype, device=spec.device) for _ in range(config.num_layers)]

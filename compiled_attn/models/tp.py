"""Megatron-style tensor parallelism for the reference model: heads and MLP columns over ranks.

Each rank of a `torch.distributed` process group (NCCL on GPU, gloo on CPU) holds:

- column-parallel q/k/v and gate/up projections: its share of query heads, of KV heads (a KV
  head is replicated on `tp // num_kv_heads` ranks when there are fewer KV heads than ranks, as
  vLLM does) and of the MLP's intermediate columns;
- row-parallel o/down projections, whose partial sums are all-reduced;
- a vocab-parallel embedding (each rank looks up its vocab rows, zeros elsewhere, all-reduce)
  and a vocab-parallel lm_head (each rank its vocab columns, all-gathered into full logits).
  Both are exact: a sum with zeros and a gather add no rounding;
- its own KV caches for its KV heads. Attention metadata is the same on every rank.

Collectives are functional (`torch.distributed._functional_collectives`): Dynamo traces them
without graph breaks under `fullgraph=True`, Inductor lowers them, and eager runs use the same
ops. Modules keep the group's *name*, a string Dynamo treats as a constant (as the attention
layers keep theirs). Weights are drawn for the full model and sliced (see `build_model`), so a
sharded model equals the unsharded one up to the order of the all-reduce sums.

Launching the ranks and capturing CUDA graphs across them: `compiled_attn.distributed`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn import functional as F  # noqa: N812

from compiled_attn.validation import as_int, indexed_device

# torch 2.13 renamed the functional all-gather (the old name warns on every eager call); 2.11 has
# only the old name
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """This rank's place in a tensor-parallel group; `group_name` is None when not sharded."""

    rank: int = 0
    size: int = 1
    group_name: str | None = None


NO_TP = TPLayout()


def layout_of(group: dist.ProcessGroup | None) -> TPLayout:
    """The layout for `group` (None or a 1-rank group: unsharded)."""
    if group is None or dist.get_world_size(group) == 1:
        return NO_TP
    return TPLayout(dist.get_rank(group), dist.get_world_size(group), group.group_name)


def local_head_counts(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) per rank; ValueError when heads cannot be split evenly.

    KV heads are split when num_kv_heads >= tp_size, otherwise each rank holds one KV head,
    replicated on tp_size // num_kv_heads ranks.

    >>> local_head_counts(32, 8, 2), local_head_counts(16, 4, 8)
    ((16, 4), (2, 1))
    """
    tp_size = as_int("tp_size", tp_size)  # not a bool (True would be one rank) nor a float
    num_heads, num_kv_heads = as_int("num_heads", num_heads), as_int("num_kv_heads", num_kv_heads)
    if num_heads % tp_size:
        raise ValueError(f"num_heads={num_heads} is not divisible by tp_size={tp_size}: each rank needs whole heads")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} is not divisible by tp_size={tp_size} (with at least as many KV "
                "heads as ranks each rank takes an equal share)"
            )
        return num_heads // tp_size, num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tp_size={tp_size} is not a multiple of num_kv_heads={num_kv_heads}: with fewer KV heads than ranks "
            "each KV head is replicated on tp_size // num_kv_heads ranks"
        )
    return num_heads // tp_size, 1


def first_kv_head(num_kv_heads: int, tp: TPLayout) -> int:
    """The first (full-model) KV head this rank holds; replicated heads go to consecutive ranks,
    so a rank's query heads use exactly the KV head(s) it holds."""
    local = max(num_kv_heads // tp.size, 1)
    return tp.rank * local if num_kv_heads >= tp.size else tp.rank * num_kv_heads // tp.size


def check_divisible(name: str, value: int, tp_size: int) -> int:
    """value // tp_size; ValueError naming `name` when it does not divide."""
    if value % tp_size:
        raise ValueError(f"{name}={value} is not divisible by tp_size={tp_size}")
    return value // tp_size


def group_backend_for(group: dist.ProcessGroup, device_type: str) -> str:
    """The backend `group` runs `device_type`'s collectives with, read from its per-device-type
    config ("cpu:gloo,cuda:gloo" for a gloo group, "cuda:nccl" for NCCL, "cpu:gloo,cuda:nccl"
    for torch's default): `get_backend` alone reports the last as "undefined"."""
    config = str(dist.get_backend_config(group)).lower()
    per_type = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return per_type.get(device_type, config) if per_type else config  # none for that type: the whole config


def check_group_device(group: dist.ProcessGroup | None, device: str | torch.device) -> None:
    """ValueError unless `group` can run collectives on `device`: NCCL for CUDA, gloo for CPU
    (a gloo group also accepts CUDA tensors, by copying through the host: too slow to serve)."""
    if group is None:
        return
    device = torch.device(device)
    backend = group_backend_for(group, device.type)
    want = {"cuda": "nccl", "cpu": "gloo"}.get(device.type)
    if want is None or backend != want:
        raise ValueError(
            f"the tensor-parallel group uses {backend!r} but the model is on {device}: use "
            f"{want or 'NCCL (CUDA) or gloo (CPU)'!r} groups for {device.type} models"
        )
    bound = getattr(group, "bound_device_id", None)
    if device.type == "cuda" and bound is not None:
        here = indexed_device(device)
        if bound != here:
            raise ValueError(f"the NCCL group is bound to {bound} but the model is on {here}")


# -------------------------------------------------------------------------------------------
# Parallel layers. Each knows how to cut its shard out of the full weight (`shard`), so that
# build_model can draw the full model's weights from the seed and keep the slices.


def all_reduce(x: torch.Tensor, tp: TPLayout) -> torch.Tensor:
    """Sum over the group (identity when unsharded)."""
    return x if tp.group_name is None else funcol.all_reduce(x, "sum", tp.group_name)


class ColumnParallelLinear(nn.Linear):
    """y = x W_local^T, where W_local stacks the full weight's `rows` ranges (no bias, no comm).

    x [num_tokens, in_features] -> [num_tokens, sum of range lengths].
    """

    def __init__(self, in_features: int, full_out_features: int, rows: Sequence[tuple[int, int]]) -> None:
        super().__init__(in_features, sum(b - a for a, b in rows), bias=False)
        self.full_shape = (full_out_features, in_features)
        self.rows = tuple(rows)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return torch.cat([full[a:b] for a, b in self.rows])


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local W[:, cols]^T): this rank's input columns, partial sums summed.

    x [num_tokens, cols length] -> [num_tokens, out_features].
    """

    def __init__(self, full_in_features: int, out_features: int, tp: TPLayout) -> None:
        local = check_divisible("in_features", full_in_features, tp.size)
        super().__init__(local, out_features, bias=False)
        self.full_shape = (out_features, full_in_features)
        self.cols = (tp.rank * local, (tp.rank + 1) * local)
        self.tp = tp

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full[:, self.cols[0] : self.cols[1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.tp)


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds vocab rows [start, stop); ids elsewhere give zeros; the sum over ranks is
    the full lookup. input_ids int64 [num_tokens] -> [num_tokens, embedding_dim]."""

    def __init__(self, vocab_size: int, embedding_dim: int, tp: TPLayout) -> None:
        local = check_divisible("vocab_size", vocab_size, tp.size)
        super().__init__(local, embedding_dim)
        self.full_shape = (vocab_size, embedding_dim)
        self.start, self.stop = tp.rank * local, (tp.rank + 1) * local
        self.tp = tp

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.start : self.stop]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # F.embedding with the weight alone: nn.Embedding.forward passes its float norm_type,
        # which torch.compile(dynamic=True) (outside `ca.floats_as_constants`) first traces as a
        # symbolic float and then, finding it cannot stay one, re-traces the whole model.
        if self.tp.group_name is None:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.start) & (input_ids < self.stop)
        local_ids = torch.where(mine, input_ids - self.start, 0)  # row 0 stands in; masked below
        x = F.embedding(local_ids, self.weight).masked_fill(~mine[:, None], 0)
        return all_reduce(x, self.tp)


class VocabParallelLMHead(nn.Linear):
    """Each rank computes logits for its vocab columns; an all-gather assembles the full row.
    x [num_tokens, in_features] -> [num_tokens, vocab_size] on every rank."""

    def __init__(self, in_features: int, vocab_size: int, tp: TPLayout) -> None:
        local = check_divisible("vocab_size", vocab_size, tp.size)
        super().__init__(in_features, local, bias=False)
        self.full_shape = (vocab_size, in_features)
        self.rows = (tp.rank * local, (tp.rank + 1) * local)
        self.tp = tp

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.rows[0] : self.rows[1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)  # [num_tokens, vocab_size // tp]
        if self.tp.group_name is None:
            return local
        # functional all-gather concatenates along dim 0 only, so gather the transposed shards
        # ([vocab_size, num_tokens]): reshaping a gathered [tp * num_tokens, ...] would need a
        # guard on the token count, which is unbacked under compile
        gathered = _all_gather(local.t().contiguous(), 0, self.tp.group_name)
        return gathered.t()  # a transposed view: [num_tokens, vocab_size]


def shard_of(module: nn.Module, full: torch.Tensor) -> torch.Tensor:
    """The part of the full parameter `full` that `module` (its owner) holds on this rank."""
    shard = getattr(module, "shard", None)
    return full if shard is None else shard(full)


def full_shape_of(module: nn.Module, param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape in the unsharded model (its own shape for replicated modules)."""
    return tuple(getattr(module, "full_shape", param.shape))

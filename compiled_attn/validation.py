"""Every check of user input, in one module: each entry point calls these before anything is written.

==========================================  ====================================================
entry point                                 checks
==========================================  ====================================================
AttentionSpec(...)                          `check_spec`
AttentionImpl(...) / ca.Attention(...)      `check_impl_args`, `check_kv_scales`, `as_attn_type`
builder.build(...)                          `int_list`, `table_rows`, `check_table_array`,
                                            `check_written_blocks`
impl.forward, ca.Attention (eager and       `check_tensors` (no metadata, so it also runs at
compiled), the runner's eager path          trace time), then inside every op before it writes
                                            or reads: `check_layer_call` (`check_step`, whose
                                            static part runs once per layer and call kind)
State.prepare_graph_input_buffers and the   `check_graph_step`: host data, before the static
runner's graph path                         buffers are refilled (a replay checks nothing)
copy_blocks / swap_blocks                   `check_block_cache`, `check_block_pairs`
==========================================  ====================================================

Inside the ops, what depends only on the layer and the kind of call (`CheckedKind`: the
metadata's class, backend, spec and cache geometry; the dtype and device; the cache) is checked
the first time a layer meets that kind and remembered per layer (`check_layer_call`); what the
metadata asks of a step's tensors is read once per forward (`StepFacts`); every call compares
only identities and each tensor's shape, dtype and device against them. No check reads device
memory (shapes, dtypes, devices and host values only), so none syncs the device.

Errors: ValueError for invalid input (whatever its Python type: a float, string, tensor or None
where an int belongs is a ValueError too, never a TypeError from deep inside), NotImplementedError
for a valid configuration a backend lacks, RuntimeError for lifecycle misuse.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import reprlib
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from compiled_attn.base import ENV_VAR, AttentionMetadata, AttentionType, kv_cache_torch_dtype

if TYPE_CHECKING:  # annotations only: `abstract` calls this module
    from compiled_attn.abstract import AttentionSpec

INT32_MAX = 2**31 - 1  # block tables, lengths and prefix sums are int32 on the device
CACHE_WRITING_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_DECODER)
CACHELESS_TYPES = (AttentionType.ENCODER, AttentionType.ENCODER_ONLY)
INT_DTYPE_KINDS = "iu"


# ---------------------------------------------------------------------------------------------
# Python values: ints, reals, enums


def check_model_output(out: object, num_tokens: int) -> torch.Tensor:
    """`out`, the model's output on `num_tokens` static rows, if it is one tensor [num_tokens, ...]:
    the graphs keep its rows and hand the step's first ones back, so anything else (a tuple,
    the last row only) would serve other rows than the step's. ValueError otherwise."""
    if not isinstance(out, torch.Tensor) or out.shape[:1] != (num_tokens,):
        got = f"{type(out).__name__} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"the model must return a tensor [num_tokens, ...]; got {got} for {num_tokens}")
    return out


def as_int(name: str, value: object, *, minimum: int | None = 1, why: str = "") -> int:
    """`value` as a python int: ints, numpy ints and 0-d integer CPU tensors pass; floats (even
    4.0), bools, strings, None and other tensors are a ValueError, as is a value outside
    [minimum, INT32_MAX] (`why` says why the maximum holds)."""
    bad_tensor = isinstance(value, torch.Tensor) and (
        value.dim() != 0 or value.dtype.is_floating_point or value.dtype == torch.bool or value.device.type != "cpu"
    )
    if isinstance(value, bool | np.bool_) or bad_tensor:
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    if out > INT32_MAX:
        raise ValueError(f"{name} must be <= {INT32_MAX}{why}, got {out}")
    return out


def as_positive_finite(name: str, value: object) -> float:
    """`value` as a float that is finite and > 0 (a real number, not a bool or a string)."""
    if isinstance(value, bool | str | bytes) or not isinstance(value, numbers.Real | torch.Tensor | np.ndarray):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}") from None
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return out


def as_attn_type(value: object) -> AttentionType:
    """An AttentionType from the enum or its value ("decoder", ...); ValueError for anything else."""
    try:
        return AttentionType(value)
    except (ValueError, TypeError):
        raise ValueError(
            f"{value!r} is not a valid AttentionType; use one of {[t.value for t in AttentionType]}"
        ) from None


def as_device(name: str, value: object) -> torch.device:
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"{name} must be a torch.device or a device string like 'cuda' or 'cpu', got {value!r}"
        ) from None


def indexed_device(device: torch.device) -> torch.device:
    """`device` with its index: a CUDA device named without one is the current one (where a
    tensor made now would land, and what its `.device` would say)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_device_available(device: torch.device) -> None:
    """A CUDA device this machine has (CPU and meta always exist); ValueError otherwise, before
    anything is allocated on it."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"the spec's device is {device} but no CUDA device is visible: use device='cpu' "
                         "(TORCH_SDPA) or run on a machine with a GPU")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"the spec's device is {device} but this machine has {torch.cuda.device_count()} "
                         "CUDA devices")


# ---------------------------------------------------------------------------------------------
# Spec and layer options (construction time)


def check_head_counts(num_heads: int, num_kv_heads: int) -> None:
    """Queries are grouped over KV heads (GQA / MQA): the counts must divide."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA/MQA)"
        )


def check_impl_options(
    num_heads: int,
    sliding_window: object,
    logits_soft_cap: object,
    alibi_slopes: object,
) -> tuple[int | None, float | None, torch.Tensor | None]:
    """The per-layer options shared by the spec and every impl, validated in one place; returns
    them normalised (window an int, soft-cap a float, slopes a float tensor)."""
    window = None
    if sliding_window is not None:
        try:
            window = as_int("sliding_window", sliding_window)
        except ValueError:
            raise ValueError(
                f"sliding_window must be None or >= 1 (an int <= {INT32_MAX}), got {sliding_window!r}"
            ) from None
    cap = None
    if logits_soft_cap is not None:
        try:
            cap = as_positive_finite("logits_soft_cap", logits_soft_cap)
        except ValueError:
            # inf is no cap at all, and tanh(s / inf) * inf is NaN
            raise ValueError(f"logits_soft_cap must be None or > 0 and finite, got {logits_soft_cap!r}") from None
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes
        if not isinstance(slopes, torch.Tensor) or not slopes.dtype.is_floating_point:
            try:
                slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"alibi_slopes must be a float tensor [num_heads], got {alibi_slopes!r}") from None
        if tuple(slopes.shape) != (num_heads,):
            raise ValueError(
                f"alibi_slopes must have shape [num_heads]=[{num_heads}], got {tuple(slopes.shape)}"
            )
        if slopes.device.type != "meta" and not bool(torch.isfinite(slopes).all()):
            raise ValueError(f"alibi_slopes must be finite, got {slopes.tolist()}")
        slopes = slopes.detach().clone()  # fixed at construction, as checked: not the caller's tensor
    return window, cap, slopes


def check_kv_cache_dtype(kv_cache_dtype: object) -> str:
    kv_cache_torch_dtype(kv_cache_dtype, torch.float32)  # ValueError for an unknown name
    return kv_cache_dtype


def check_spec(spec: AttentionSpec) -> dict[str, Any]:
    """Every field of `spec`, checked; returns the values to store (ints, torch.device, float
    slopes, the AttentionType). The device need not exist here: see check_device_available."""
    out: dict[str, Any] = {}
    for name in ("num_heads", "num_kv_heads", "head_size", "block_size", "num_blocks", "max_seq_len_to_capture"):
        why = " (block ids are int32 on the device)" if name == "num_blocks" else ""
        out[name] = as_int(f"AttentionSpec.{name}", getattr(spec, name), why=why)
    check_head_counts(out["num_heads"], out["num_kv_heads"])
    if not isinstance(spec.dtype, torch.dtype) or not spec.dtype.is_floating_point:
        raise ValueError(
            f"AttentionSpec.dtype must be a floating torch.dtype (torch.bfloat16, ...), got {spec.dtype!r}"
        )
    out["device"] = as_device("AttentionSpec.device", spec.device)
    check_kv_cache_dtype(spec.kv_cache_dtype)
    if spec.scale is not None:
        out["scale"] = as_positive_finite("AttentionSpec.scale", spec.scale)
    window, cap, slopes = check_impl_options(out["num_heads"], spec.sliding_window, spec.logits_soft_cap,
                                             spec.alibi_slopes)
    out.update(sliding_window=window, logits_soft_cap=cap, alibi_slopes=slopes, attn_type=as_attn_type(spec.attn_type))
    return out


def check_impl_args(
    num_heads: object, head_size: object, scale: object, num_kv_heads: object, alibi_slopes: object,
    sliding_window: object, kv_cache_dtype: object, logits_soft_cap: object,
) -> dict[str, Any]:
    """An impl's constructor arguments, checked and normalised (ALiBi slopes as float32)."""
    num_heads = as_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else as_int("num_kv_heads", num_kv_heads)
    check_head_counts(num_heads, num_kv_heads)
    if alibi_slopes is not None and isinstance(alibi_slopes, torch.Tensor | Sequence | np.ndarray):
        try:
            alibi_slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"alibi_slopes must be a float tensor [num_heads], got {alibi_slopes!r}") from None
    window, cap, slopes = check_impl_options(num_heads, sliding_window, logits_soft_cap, alibi_slopes)
    return dict(
        num_heads=num_heads, head_size=as_int("head_size", head_size), scale=as_positive_finite("scale", scale),
        num_kv_heads=num_kv_heads, alibi_slopes=slopes, sliding_window=window,
        kv_cache_dtype=check_kv_cache_dtype(kv_cache_dtype), logits_soft_cap=cap,
    )


def check_kv_scales(k_scale: object, v_scale: object) -> tuple[float, float]:
    # fp8 caches store K / k_scale
    return as_positive_finite("k_scale", k_scale), as_positive_finite("v_scale", v_scale)


# ---------------------------------------------------------------------------------------------
# The builder: lengths and block tables (host lists / arrays)


def host_int_tensor(t: torch.Tensor) -> bool:
    """A dense CPU tensor of ints, which numpy reads as one: lengths and tables on another device
    (CUDA, meta, MPS), sparse, or of floats, complex numbers or bools are refused, naming the argument."""
    dtype = t.dtype
    return t.device.type == "cpu" and t.layout == torch.strided and not (
        dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def int_list(values: object, what: str) -> list[int]:
    """A 1-D sequence of ints (list, tuple, numpy array or CPU tensor) as a list of python ints,
    each <= INT32_MAX (they become int32 on the device); ValueError otherwise. Lower bounds are
    the caller's (they come with their own messages)."""
    if isinstance(values, torch.Tensor | np.ndarray):
        ints = host_int_tensor(values) if isinstance(values, torch.Tensor) else values.dtype.kind in INT_DTYPE_KINDS
        if values.ndim != 1 or not ints:
            where = f" on {values.device} ({values.layout})" if isinstance(values, torch.Tensor) else ""
            raise ValueError(
                f"{what} must be a 1-D host array of ints, got {values.dtype} {tuple(values.shape)}{where}")
        out = values.tolist()
    elif isinstance(values, list | tuple | range):
        out = values if type(values) is list and all(type(v) is int for v in values) else [
            as_int(f"{what}[{i}]", v, minimum=None) for i, v in enumerate(values)]
    else:
        raise ValueError(f"{what} must be a list of ints, got {type(values).__name__}")
    if out and (max(out) > INT32_MAX or min(out) < -INT32_MAX):
        raise ValueError(f"{what} must hold ints within int32 (the device's lengths), got {max(out, key=abs)}")
    return list(out)


def int_array(values: object, what: str) -> np.ndarray:
    """`int_list`'s checks, returning int64 numpy (may be `values` itself): an int array or CPU
    tensor is checked as an array (no per-element Python), anything else through `int_list`."""
    if isinstance(values, torch.Tensor) and host_int_tensor(values):
        values = values.numpy()
    if not (isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in INT_DTYPE_KINDS):
        return np.array(int_list(values, what), dtype=np.int64)
    if values.size and (values.max() > INT32_MAX or values.min() < -INT32_MAX):
        int_list(values, what)  # raises, naming the value
    return values.astype(np.int64, copy=False)


def check_total(lens: list[int], what: str) -> None:
    """Prefix sums of `lens` are int32 on the device."""
    if sum(lens) > INT32_MAX:
        raise ValueError(f"sum({what})={sum(lens)} > {INT32_MAX}: a step's tokens must fit int32")


def holds_a_bool(row: list | tuple) -> bool:
    """Whether a bool (python, numpy, or a 0-d bool tensor or array) is among `row`'s entries,
    which np.asarray would turn into ints among ints. The type scan runs at C speed; entries are
    looked at one by one only where tensors or arrays are among them."""
    types = set(map(type, row))
    return not {bool, np.bool_}.isdisjoint(types) or (
        any(issubclass(t, torch.Tensor | np.ndarray) for t in types)
        and any(isinstance(x, torch.Tensor | np.ndarray) and x.dtype in (torch.bool, np.bool_) for x in row))


def _block_row(row: object, what: str) -> np.ndarray:
    """One request's needed block ids as int64 (ints only: not floats, bools, strings or None)."""
    if isinstance(row, torch.Tensor):
        if not host_int_tensor(row):
            raise ValueError(
                f"{what} must hold integer block ids on the host, got a {row.dtype} tensor on {row.device}"
            )
        row = row.numpy()
    elif isinstance(row, list | tuple) and holds_a_bool(row):
        raise ValueError(f"{what} holds a bool: block ids are ints, got {list(row)!r}")
    try:
        a = np.asarray(row)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{what} must hold int block ids, got {row!r}") from None
    if a.dtype.kind in INT_DTYPE_KINDS and a.ndim != 1:  # a 3-D table array's row, say
        raise ValueError(f"{what} must be one row of block ids, got an array of shape {a.shape}")
    if a.dtype.kind not in INT_DTYPE_KINDS:
        items = list(row) if isinstance(row, list | tuple) else list(np.ravel(a))
        bad = [b for b in items if not isinstance(b, numbers.Integral)]
        if not bad:  # python ints past int64
            raise ValueError(f"{what} names block {max(items, key=abs)}, outside any cache")
        raise ValueError(f"{what} holds block id {bad[0]!r}: block ids are ints")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what} names block {int(a.max())}, outside any cache")
    return a.astype(np.int64, copy=False)


def table_rows(block_tables: object, lens: list[int], block_size: int, what: str,
               rolled: np.ndarray | None = None) -> list[np.ndarray]:
    """Each request's needed blocks (the first ceil(len / block_size) of its table) as int64 arrays.

    Entries past a request's need are ignored: never read, checked or copied to the device; so
    are the first rolled[i] of row i (a rolling table's entries the window left behind).
    ValueError for a table that is not a list (or array) of ints, or too short for its request.
    """
    if not isinstance(block_tables, list | tuple | np.ndarray | torch.Tensor):
        raise ValueError(f"{what} must be a list of lists of block ids, got {type(block_tables).__name__}")
    if len(block_tables) != len(lens):
        raise ValueError(f"len({what})={len(block_tables)} != number of requests {len(lens)}")
    heads, needs = [], []
    for i, (table, n) in enumerate(zip(block_tables, lens, strict=True)):
        need = -(-n // block_size)
        try:
            have = len(table)
        except TypeError:
            raise ValueError(f"{what}[{i}] must be a list of block ids, got {type(table).__name__}") from None
        if have < need:
            raise ValueError(
                f"{what}[{i}] has {have} blocks but seq_len={n} needs {need} of block_size={block_size}"
            )
        first = 0 if rolled is None else int(rolled[i])
        try:
            heads.append(table[first:need])
        except TypeError:  # sized but not ordered: a set, say
            raise ValueError(f"{what}[{i}] must be a list of block ids, got {type(table).__name__}") from None
        needs.append(need - first)
    if all(type(h) is list for h in heads):  # lists of python ints: one conversion for the whole step
        flat = list(itertools.chain.from_iterable(heads))
        if set(map(type, flat)) <= {int} and (not flat or min(flat) >= -(2**63) and max(flat) < 2**63):
            return np.split(np.array(flat, dtype=np.int64), np.cumsum(needs)[:-1])
    return [_block_row(h, f"{what}[{i}]") for i, h in enumerate(heads)]


def check_block_ids(ids: np.ndarray, row_ends: np.ndarray, num_blocks: int, what: str,
                    scratch: np.ndarray | None = None, keep_marks: bool = False) -> bool:
    """Block ids the requests read (`ids`, request i's in ids[row_ends[i-1]:row_ends[i]]) exist in
    the cache, and no request names a block twice (its blocks hold different positions). Returns
    whether any block is named more than once in the step (by several requests: shared prefix
    blocks), which `check_written_blocks` then looks at. `scratch`: bool [>= num_blocks], all
    False, left all False (a builder keeps one: a fresh array of a large cache's size costs its
    page faults each step), or with `keep_marks` left True at `ids` when it returns False
    (`block_ids.BlockIdCheck` checks the next step against them)."""
    if not ids.size:
        return False
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        k = int(np.argmax((ids < 0) | (ids >= num_blocks)))
        raise ValueError(f"{what}[{_row_of(k, row_ends)}] names block {ids[k]}, outside the cache's "
                         f"0..{num_blocks - 1}")
    ids = ids.astype(np.intp, copy=False)  # in range: one conversion, not one inside each scatter
    # O(n) first: mark each named block in a bitmap; fewer marks than entries means a block is
    # named twice. Byte-wide marks scatter 4-6x faster than the entries' int64 indices did. The
    # scatter is the cost (~1.5 ns an entry, 256 requests x 257 blocks: ~0.1 ms on a 2-core
    # machine), so the marks are counted and cleared over bytes lo..hi at memory speed (~50x
    # cheaper per byte) rather than scattered back. Only then the sort.
    seen = np.zeros(num_blocks, dtype=bool) if scratch is None else scratch
    seen[ids] = True
    marked = seen[lo : hi + 1]
    distinct = int(np.count_nonzero(marked))
    if distinct == ids.size:
        if not keep_marks:
            marked.fill(False)
        return False
    marked.fill(False)
    uniq, counts = np.unique(ids, return_counts=True)
    sub = np.isin(ids, uniq[counts > 1])  # every entry of a repeated block
    rows = np.searchsorted(row_ends, np.flatnonzero(sub), side="right")
    keys = np.sort(rows * num_blocks + ids[sub])  # (request, block) pairs, sorted
    dup = keys[1:] == keys[:-1]
    if dup.any():
        i, b = divmod(int(keys[1:][dup][0]), num_blocks)
        raise ValueError(f"{what}[{i}] names block {b} twice: a request's blocks hold different positions, so "
                         "they are distinct")
    return True


def _row_of(k: int, row_ends: np.ndarray) -> int:
    """The request of flat entry k (row_ends: cumulative entries per request)."""
    return int(np.searchsorted(row_ends, k, side="right"))


def needed_table(block_tables: object, lens: np.ndarray, block_size: int, what: str,
                 rolled: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every request's needed blocks (the first ceil(len / block_size) of its table) as
    (padded int32 [num_seqs, max(1, max need)] with block 0 past each need, the needed ids
    flat in request order, row_ends int64 [num_seqs]: cumulative ids per request, need int64
    [num_seqs]: that ceil per request, rolled entries included). The ids are
    int64 from lists and keep an array's int dtype (`live_entries`); `check_block_ids` takes both.

    `block_tables`: a list of per-request lists (or arrays), or one 2-D integer array / CPU
    tensor [num_seqs, >= max need] (no per-element Python work: what a server keeps). Entries
    past a request's need are ignored: never read, checked or copied to the device.
    `rolled`: int64 [num_seqs] or None, leading entries of each row that a sliding window has
    left behind (a rolling table): ignored too, block 0 in the padded table, not among the ids.
    """
    need = -(-lens.astype(np.int64) // block_size)
    width = max(int(need.max(initial=0)), 1)
    if isinstance(block_tables, np.ndarray | torch.Tensor) and block_tables.ndim == 2:
        padded, ids = live_entries(_table_array(block_tables, need, what)[:, :width], need, rolled)
        return padded, ids, np.cumsum(need if rolled is None else need - rolled), need
    rows = table_rows(block_tables, lens.tolist(), block_size, what, rolled)  # exactly the needed entries
    padded = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        padded[i, need[i] - row.size : need[i]] = row
    ids = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return padded, ids, np.cumsum([r.size for r in rows]), need


def rolled_blocks(starts: np.ndarray, sliding_window: int, block_size: int) -> np.ndarray:
    """Per request, the leading blocks wholly before the window of its first new token (at
    position starts[i]): no query of the step sees them (int64 [num_seqs])."""
    return np.maximum(starts.astype(np.int64) - sliding_window + 1, 0) // block_size


def live_entries(table: np.ndarray, need: np.ndarray,
                 rolled: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(table as int32 with block 0 outside each row's live entries, the live ids flat in row
    order, in the table's dtype) of an int table [num_seqs, width] whose row i reads entries
    rolled[i]..need[i]-1 (rolled None: from 0)."""
    if rolled is None and need.size and bool((need == table.shape[1]).all()):  # every row full: no mask
        padded = table.astype(np.int32)
        # ids in the table's own dtype, so that a wider one is range-checked before it is narrowed;
        # an int32 table's are the copy's (no second copy). Never a view of the caller's array:
        # the metadata keeps the ids, and a table edited after build() must not change them.
        return padded, padded.reshape(-1) if table.dtype == np.int32 else table.flatten()
    cols = np.arange(table.shape[1], dtype=np.int32)[None, :]  # int32: compares 2x faster than int64
    live = cols < need.astype(np.int32)[:, None]
    if rolled is not None:
        live &= cols >= rolled.astype(np.int32)[:, None]
    # a product, not np.where (3x slower); a wider table wraps in the int32 copy, but its ids keep
    # their dtype and the range check refuses them before the copy is used
    return np.multiply(table, live, dtype=np.int32, casting="unsafe"), table[live]


def _table_array(tables: np.ndarray | torch.Tensor, need: np.ndarray, what: str) -> np.ndarray:
    """A 2-D host array of int block ids with a row per request, each as long as its need."""
    if isinstance(tables, torch.Tensor):
        if not host_int_tensor(tables):
            raise ValueError(f"{what} must hold integer block ids on the host, got a {tables.dtype} tensor on "
                             f"{tables.device}")
        tables = tables.numpy()
    if tables.dtype.kind not in INT_DTYPE_KINDS:
        raise ValueError(f"{what} must hold integer block ids, got a {tables.dtype} array")
    if tables.shape[0] != need.shape[0]:
        raise ValueError(f"len({what})={tables.shape[0]} != number of requests {need.shape[0]}")
    if need.size and int(need.max()) > tables.shape[1]:
        i = int(np.argmax(need > tables.shape[1]))
        raise ValueError(f"{what}[{i}] has {tables.shape[1]} blocks but needs {int(need[i])} for its tokens")
    return tables  # its live ids are range-checked in their own dtype (check_block_ids); the rest is never read


def check_table_array(tables: np.ndarray, lens: Sequence[int], block_size: int, num_blocks: int, what: str,
                      rolled: np.ndarray | None = None) -> None:
    """`check_block_ids` on a padded host table (int [num_seqs, width], what the device got): row i's
    first ceil(lens[i] / block_size) entries are the ones read, less its first rolled[i]."""
    need = -(-np.asarray(lens, dtype=np.int64) // block_size)
    if tables.ndim != 2 or tables.shape[0] != need.shape[0] or (need.size and need.max() > tables.shape[1]):
        raise ValueError(f"{what}: a [{need.shape[0]}, >= {need.max(initial=0)}] table is needed, got "
                         f"{tuple(tables.shape)}")
    ids = live_entries(tables, need, rolled)[1]
    check_block_ids(ids, np.cumsum(need if rolled is None else need - rolled), num_blocks, what)


def check_written_blocks(slots: np.ndarray, writers: Sequence[int], ids: np.ndarray, row_ends: np.ndarray,
                         block_size: int, what: str) -> None:
    """A block written this step belongs to one request: no two requests write one slot, and no
    request reads a block another one writes (share only full blocks nobody writes this step).
    Call it only when `check_block_ids` found a block named more than once (otherwise it holds).

    slots: int64 cache slots written, in request order; writers: tokens written per request
    (requests 0..len(writers)-1); ids / row_ends: every request's needed blocks (`needed_table`).
    """
    named = np.sort(ids)
    shared = named[1:][named[1:] == named[:-1]]  # named by several requests (rows hold distinct blocks)
    if not slots.size or not shared.size:
        return
    clash = np.intersect1d(shared, slots // block_size)
    if clash.size:
        b = int(clash[0])
        own = int(np.repeat(np.arange(len(writers)), writers)[slots // block_size == b][0])
        request = np.searchsorted(row_ends, np.arange(ids.size), side="right")
        other = int(request[(ids == b) & (request != own)][0])
        raise ValueError(
            f"{what}: block {b} is written this step by request {own} and named by request {other} too "
            "(two requests writing one slot, or one reading what another writes): a block being written "
            "belongs to one request"
        )


# ---------------------------------------------------------------------------------------------
# Layer x spec (static: depends on nothing that changes per step)


def check_layer_for_spec(impl: Any, attn_type: AttentionType, spec: AttentionSpec | None) -> None:
    """The layer can run on metadata built for `spec`: same head layout, and a layer that reads
    and writes a cache only on a spec that has one. Backends that plan from the spec add their
    own checks in `impl.check_matches_metadata` (which also sees the tensors' dtypes)."""
    if spec is None:
        raise ValueError("the metadata has no spec: build it with the backend's builder")
    for name in ("num_heads", "num_kv_heads", "head_size"):
        if getattr(impl, name) != getattr(spec, name):
            raise ValueError(
                f"layer has {name}={getattr(impl, name)} but the metadata's spec has {getattr(spec, name)}: "
                "build the metadata with this layer group's spec"
            )
    if attn_type in CACHE_WRITING_TYPES and spec.attn_type in CACHELESS_TYPES:
        raise ValueError(
            f"a {attn_type.name} layer attends over a KV cache, but the metadata was built for a "
            f"{spec.attn_type.name} spec, which has none: build it with this layer group's spec"
        )


# ---------------------------------------------------------------------------------------------
# The forward: tensors without metadata (trace time too), then the step (inside every op)


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_cache_tensor(impl: Any, kv_cache: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cache of this layer's layout and cache dtype, on `device`."""
    cache = _tensor("kv_cache", kv_cache)
    if cache.dim() != 5 or cache.shape[0] != 2 or tuple(cache.shape[3:]) != (impl.num_kv_heads, impl.head_size):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {impl.num_kv_heads}, {impl.head_size}], "
            f"got {tuple(cache.shape)}"
        )
    if cache.device != device:
        raise ValueError(f"kv_cache is on {cache.device}, query on {device}: move them to one device")
    want = kv_cache_torch_dtype(impl.kv_cache_dtype, dtype)
    if cache.dtype != want:
        raise ValueError(
            f"kv_cache dtype {cache.dtype} != {want} (kv_cache_dtype={impl.kv_cache_dtype!r}, query "
            f"{dtype}): allocate the cache with kv_cache_torch_dtype(kv_cache_dtype, model dtype)"
        )
    return cache


def check_tensors(
    impl: Any,
    query: object,
    key: object,
    value: object,
    kv_cache: object,
    attn_type: AttentionType,
) -> None:
    """Types, shapes, dtypes and devices of a layer call: query [num_tokens, num_heads * head_size],
    key/value [num_tokens, num_kv_heads * head_size] (or both None for cross attention), the
    cache for cache-writing types. Needs no metadata, so it runs at trace time too."""
    q_width = impl.num_heads * impl.head_size
    kv_width = impl.num_kv_heads * impl.head_size
    query = _tensor("query", query)
    if query.dim() != 2 or query.shape[1] != q_width:
        raise ValueError(
            f"query must be [num_tokens, num_heads * head_size = {q_width}], got {tuple(query.shape)}"
        )
    if not query.dtype.is_floating_point:
        raise ValueError(f"query/key/value dtype {query.dtype} must be one float dtype")
    if (key is None) != (value is None):
        raise ValueError("key and value must both be tensors or both be None")
    if key is None:
        if attn_type != AttentionType.ENCODER_DECODER:
            raise ValueError(f"key/value may be None only for cross attention, not {attn_type.name}")
    else:
        for name, t in (("key", key), ("value", value)):
            t = _tensor(name, t)
            if t.dim() != 2 or t.shape[1] != kv_width:
                raise ValueError(
                    f"{name} must be [num_tokens, num_kv_heads * head_size = {kv_width}], got {tuple(t.shape)}"
                )
            if t.dtype != query.dtype:
                raise ValueError(f"{name} dtype {t.dtype} != query dtype {query.dtype}")
            if t.device != query.device:
                raise ValueError(f"{name} is on {t.device}, query on {query.device}: move them to one device")
    if attn_type in CACHE_WRITING_TYPES:
        if kv_cache is None:
            raise ValueError(f"{attn_type.name} attention needs a kv_cache")
        check_cache_tensor(impl, kv_cache, query.dtype, query.device)


def check_metadata(md: object, backend_name: str) -> AttentionMetadata:
    """Metadata from `backend_name`'s builder (or State)."""
    if not isinstance(md, AttentionMetadata):
        raise ValueError(f"attn_metadata must be AttentionMetadata from a builder, got {type(md)}")
    built_by = getattr(md, "backend_name", None) or type(md).__name__
    if built_by != backend_name:
        raise ValueError(
            f"{backend_name} got metadata built for {built_by}; build it with {backend_name}'s builder "
            f"(backend.get_builder_cls()(spec).build(...)), or give the layers {built_by}: "
            f"ca.Attention(..., backend={built_by!r}) or ${ENV_VAR}={built_by} (a layer without a backend picks "
            "one without knowing the cache's block size, which the builder's backend may need)"
        )
    return md


def check_step(
    impl: Any,
    attn_type: AttentionType,
    md: AttentionMetadata,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
) -> None:
    """Everything about one layer call that needs the metadata, checked before the op writes or
    reads anything: which builder made `md`, the layer against its spec, each tensor's trailing
    shape, dtype and device, the cache's shape and layout, what the backend planned from the
    spec (`impl.check_matches_metadata`) — all fixed by the layer and the kind of call — then the
    rows against the step's tokens (`check_step_rows`). query: [num_tokens, num_heads,
    head_size], key/value: [num_tokens, num_kv_heads, head_size] or None (the ops' views). Host
    values only: runs inside the ops, where the metadata is, at run time (`check_layer_call`)."""
    check_metadata(md, impl.backend_cls.get_name())
    check_layer_for_spec(impl, attn_type, md.spec)
    device = md.slot_mapping.device
    query = _tensor("query", query)
    if not query.dtype.is_floating_point:
        raise ValueError(f"query/key/value dtype {query.dtype} must be one float dtype")
    if (key is None) != (value is None):
        raise ValueError("key and value must both be tensors or both be None")
    if key is None and attn_type in CACHELESS_TYPES:  # the attention ops read only the cache of the others
        raise ValueError(f"{attn_type.name} attention reads the step's key and value (it has no cache): they may "
                         "not be None")
    for name, t, heads in (("query", query, impl.num_heads), ("key", key, impl.num_kv_heads),
                           ("value", value, impl.num_kv_heads)):
        if t is None:
            continue
        if _tensor(name, t).dim() != 3 or tuple(t.shape[1:]) != (heads, impl.head_size):
            raise ValueError(f"{name} must be [num_tokens, {heads}, {impl.head_size}] here, got {tuple(t.shape)}")
        if t.dtype != query.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != query dtype {query.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on device {t.device}, the metadata on {device}: build it on the query's")
        _check_head_dim(name, t)
    if attn_type in CACHE_WRITING_TYPES:
        cache = check_cache_tensor(impl, kv_cache, query.dtype, device)
        want = (2, md.num_blocks, md.block_size, impl.num_kv_heads, impl.head_size)
        if tuple(cache.shape) != want:
            raise ValueError(
                f"kv_cache has shape {tuple(cache.shape)}, expected {want} (kv, num_blocks, block_size, "
                "num_kv_heads, head_size) for this spec and these keys: allocate it with "
                "backend.get_kv_cache_shape(...)"
            )
        if not cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous (allocate it with torch.empty(shape))")
    impl.check_matches_metadata(query, kv_cache, md, attn_type)  # what a backend planned from the spec
    check_step_rows(attn_type, md, query, key, value)


def step_rows(attn_type: AttentionType, md: AttentionMetadata) -> tuple[int, int]:
    """(query rows, key / value rows) a layer of `attn_type` must bring to the step `md`;
    ValueError when the metadata lacks what this attention type needs of it."""
    num_tokens = md.num_prefill_tokens + md.num_decode_tokens
    if attn_type == AttentionType.ENCODER:
        if md.encoder_seq_lens is None:
            raise ValueError("ENCODER attention needs metadata built with encoder_seq_lens")
        return md.num_encoder_tokens, md.num_encoder_tokens
    if attn_type == AttentionType.ENCODER_ONLY:
        if md.num_decode_tokens or sum(md.seq_lens) != num_tokens:
            raise ValueError("ENCODER_ONLY batches are fresh prompts (seq_len == query_len, no decodes)")
    elif attn_type == AttentionType.ENCODER_DECODER:
        if md.cross_block_tables is None:
            raise ValueError("ENCODER_DECODER attention needs metadata built with cross_block_tables")
        return num_tokens, md.cross_slot_mapping.shape[0]  # the prefills' encoder tokens
    return num_tokens, num_tokens


def check_step_rows(attn_type: AttentionType, md: AttentionMetadata, query: torch.Tensor, key: torch.Tensor | None,
                    value: torch.Tensor | None) -> None:
    """The part of `check_step` that changes every step: what this attention type needs of the
    step's metadata, and the query / key / value rows against its tokens."""
    expect, kv_rows = step_rows(attn_type, md)
    if attn_type == AttentionType.ENCODER_DECODER and key is None and md.num_prefills:
        raise ValueError(
            f"ENCODER_DECODER attention on a step with {md.num_prefills} prefills needs their encoder "
            "key/value (written at the cross slots now); key/value may be None on decode-only steps"
        )
    if query.shape[0] != expect:
        raise ValueError(
            f"{attn_type.name} attention got {query.shape[0]} query tokens but the metadata describes "
            f"{expect}: build the metadata for this batch"
        )
    if key is not None and (key.shape[0] != kv_rows or value.shape[0] != kv_rows):
        raise ValueError(
            f"key/value have {key.shape[0]}/{value.shape[0]} tokens but the metadata's slot_mapping has "
            f"{kv_rows}: build the metadata for this batch"
        )


def check_output(query: torch.Tensor, output: object) -> None:
    """An attention op's `output`: the query's shape, dtype and device (the op writes every row),
    contiguous (FlashInfer's kernels write rows num_heads * head_size apart, whatever the strides)."""
    out = _tensor("output", output)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"output must be like the query ({query.dtype} {tuple(query.shape)} on {query.device}), "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"output has strides {out.stride()}: it must be contiguous (torch.empty_like(query) is)")


def head_dim_contiguous(t: torch.Tensor) -> bool:
    """Whether each head of `t` ([..., head_size]) is one run of memory. Rows and heads may have
    any strides (a fused QKV projection's column slices); the kernels read a head as one run
    (FlashInfer's would misread a strided one). is_contiguous() first: a flag, where the strides
    cost about twice its host time (the repeat calls' checks run it too); stride()[-1] is cheaper
    than stride(-1), which parses a dim (a contiguous tensor, 0-d included, never gets there)."""
    return t.is_contiguous() or t.stride()[-1] == 1


def _check_head_dim(name: str, t: torch.Tensor) -> None:
    if not head_dim_contiguous(t):
        raise ValueError(f"{name} {tuple(t.shape)} has strides {t.stride()}: its head dimension must be contiguous "
                         f"(stride 1 in the last dim): pass {name}.contiguous()")


# ---------------------------------------------------------------------------------------------
# The step, lean: static checks once per layer and kind of call, identities and rows every call

# Kinds of call a layer remembers as checked. Its cache write and attention op share one per
# metadata kind; a layer meeting more (a new spec every step) starts over: bounded.
CALL_KINDS_KEPT = 8
# Metadata kinds interned at once (`metadata_kind`); more (a new spec every step) start over.
METADATA_KINDS_KEPT = 64


class MetadataKind(NamedTuple):
    """What `check_step` reads of a step's metadata besides its rows: its class, backend, spec (by
    identity: specs are frozen), cache geometry and device. Interned, so that a layer recognises
    a kind it passed by identity; holding the spec keeps its id from being reused meanwhile."""

    key: tuple
    spec: object


_metadata_kinds: dict[tuple, MetadataKind] = {}


def metadata_kind(md: object) -> MetadataKind | None:
    """`md`'s interned `MetadataKind`, or None for an object that is not a builder's metadata
    (every call over it is checked in full, which names what is wrong)."""
    try:
        # rolling or not: a builder's choice, not the spec's, which a layer's checks depend on
        key = (type(md), md.backend_name, id(md.spec), md.num_blocks, md.block_size, md.slot_mapping.device,
               getattr(md, "rolled_blocks", None) is not None)
    except (AttributeError, TypeError):
        return None
    kind = _metadata_kinds.get(key)
    if kind is None:
        if len(_metadata_kinds) >= METADATA_KINDS_KEPT:
            _metadata_kinds.clear()
        kind = _metadata_kinds[key] = MetadataKind(key, md.spec)
    return kind


class StepFacts:
    """What every op's checks read of one forward's metadata, read once per forward and layer
    group (`ForwardContext.step_facts`) instead of once per op call: the metadata, its
    `metadata_kind` and, per attention type, the shapes the step's tensors must have."""

    __slots__ = ("md", "kind", "_shapes")

    def __init__(self, md: AttentionMetadata) -> None:
        self.md, self.kind = md, metadata_kind(md)
        self._shapes: dict[AttentionType, tuple | None] = {}

    def shapes(self, attn_type: AttentionType) -> tuple[tuple, tuple, bool] | None:
        """(query shape, key / value shape, whether key / value may not be None) of a layer of
        `attn_type` and of the spec's heads on this step, or None where the metadata lacks what
        the type needs (the full check says what)."""
        if attn_type not in self._shapes:
            try:
                rows, kv_rows = step_rows(attn_type, self.md)
                spec = self.md.spec
                # key / value are read by the cacheless types, and by a cross step's prefills
                self._shapes[attn_type] = ((rows, spec.num_heads, spec.head_size),
                                           (kv_rows, spec.num_kv_heads, spec.head_size),
                                           attn_type in CACHELESS_TYPES or (attn_type == AttentionType.ENCODER_DECODER
                                                                            and self.md.num_prefills > 0))
            except (ValueError, AttributeError, TypeError):
                self._shapes[attn_type] = None
        return self._shapes[attn_type]


class CheckedKind:
    """A kind of call a layer passed `check_step` with: the metadata kind, the query's dtype and
    device (every input's, then) and the cache (held weakly: a layer must not keep a dropped
    cache alive), recognised by identity or, for a fresh view of it, by its shape, dtype,
    device and layout."""

    __slots__ = ("metadata", "dtype", "device", "cache", "cache_facts")

    def __init__(self, metadata: MetadataKind, query: torch.Tensor, kv_cache: torch.Tensor | None) -> None:
        self.metadata, self.dtype, self.device = metadata, query.dtype, query.device
        self.cache = None if kv_cache is None else weakref.ref(kv_cache)
        self.cache_facts = None if kv_cache is None else _cache_facts(kv_cache)

    def matches(self, metadata: MetadataKind, dtype: torch.dtype, device: torch.device,
                kv_cache: torch.Tensor | None) -> bool:
        if self.metadata is not metadata or self.dtype is not dtype or self.device != device:
            return False
        if kv_cache is None or self.cache is None:
            return kv_cache is self.cache
        # all of it for the same tensor too: a cache resized or restrided in place (`resize_`,
        # `set_`, `as_strided_`), or given another dtype or device (`.data =`, as `module.to()` /
        # `.half()` do to a Parameter), must be checked again
        facts = self.cache_facts
        if (self.cache() is kv_cache and kv_cache.shape == facts[0] and kv_cache.dtype is facts[1]
                and kv_cache.device == facts[2] and kv_cache.is_contiguous()):
            return True
        return _cache_facts(kv_cache) == self.cache_facts


def _cache_facts(kv_cache: torch.Tensor) -> tuple:
    return kv_cache.shape, kv_cache.dtype, kv_cache.device, kv_cache.is_contiguous()


def check_layer_call(call: Any, step: StepFacts, query: torch.Tensor, key: torch.Tensor | None,
                     value: torch.Tensor | None, kv_cache: torch.Tensor | None,
                     output: torch.Tensor | None = None) -> None:
    """`check_step` (and `check_output` for an attention op's `output`) of the layer `call` (a
    `forward_context.LayerCall`) on the step `step`, as every op runs it.

    The first call of a kind (`CheckedKind`: what depends only on the layer, the metadata's kind,
    the dtype and the cache) runs every check; once it passed, the layer remembers the kind
    (`call.checked_kinds`; its cache write and attention op share it), and later calls of that
    kind compare only what changes per step: the metadata's kind by identity, the query's dtype
    and device, the cache, and each tensor's shape, dtype, device and layout (its head dimension
    contiguous; the output contiguous) against the step's rows (`StepFacts.shapes`). Any
    difference, valid or not, runs the full check, so a refused call raises every time, with the
    full check's error. The layer's own options are fixed at construction (`check_impl_args`),
    so they are not part of the kind."""
    if _passed_before(call, step, query, key, value, kv_cache, output):
        return
    check_step(call.impl, call.attn_type, step.md, query, key, value, kv_cache)
    if output is not None:
        check_output(query, output)
    if step.kind is not None:
        checked = call.checked_kinds
        if len(checked) >= CALL_KINDS_KEPT:
            checked.clear()
        checked.insert(0, CheckedKind(step.kind, query, kv_cache))


def _passed_before(call: Any, step: StepFacts, query: torch.Tensor, key: torch.Tensor | None,
                   value: torch.Tensor | None, kv_cache: torch.Tensor | None, output: torch.Tensor | None) -> bool:
    """Whether this call is of a kind the layer passed and its tensors fit the step (False for
    anything else, arguments that are not tensors included: the full check then decides)."""
    shapes = step.shapes(call.attn_type)
    if shapes is None or not isinstance(query, torch.Tensor):
        return False
    q_shape, kv_shape, kv_needed = shapes
    dtype, device = query.dtype, query.device
    if query.shape != q_shape:
        return False
    for kind in call.checked_kinds:
        if kind.matches(step.kind, dtype, device, kv_cache):
            break
    else:
        return False
    if key is None or value is None:
        if key is not value or kv_needed:
            return False
    elif not (key.shape == kv_shape and value.shape == kv_shape and key.dtype is dtype and value.dtype is dtype
              and key.device == device and value.device == device
              and head_dim_contiguous(key) and head_dim_contiguous(value)):
        return False
    if not head_dim_contiguous(query):
        return False
    return output is None or (output.shape == q_shape and output.dtype is dtype and output.device == device
                              and output.is_contiguous())


class CapturedWrite(NamedTuple):
    """A cache write that piecewise graphs capture inside a piece (`graphs.split.is_captured_write`):
    the layer (a `forward_context.LayerCall`), its query / key dtype and trailing shapes, and
    the cache it writes."""

    call: Any
    dtype: torch.dtype
    query_shape: tuple[int, ...]  # [num_heads, head_size]
    key_shape: tuple[int, ...]  # [num_kv_heads, head_size]
    cache: torch.Tensor


def check_captured_writes(md: AttentionMetadata, writes: Sequence[CapturedWrite]) -> None:
    """`check_layer_call` of every captured write on the step `md`, as its op would run it
    before writing, with stand-in query / key / value of the step's rows (no memory: every row
    views one) and the real cache. Piecewise graphs call it before replaying writes that run no
    Python, once per metadata kind (the layers remember the kinds they passed)."""
    step, rows, device = StepFacts(md), md.num_tokens, md.slot_mapping.device  # the step's, as the op's inputs
    for write in writes:
        query = _stand_in(rows, write.query_shape, write.dtype, device)
        key = _stand_in(rows, write.key_shape, write.dtype, device)
        check_layer_call(write.call, step, query, key, key, write.cache)


def _stand_in(rows: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [rows, *shape] tensor whose rows all view one contiguous row: what the checks read of a
    tensor (shape, dtype, device, a contiguous head dimension) at the cost of one row."""
    row = torch.empty(shape, dtype=dtype, device=device)
    return row.as_strided((rows, *shape), (0, *row.stride()))


# ---------------------------------------------------------------------------------------------
# Graph replay: everything a replay would otherwise read unchecked


# AttentionSpec's fields a step's metadata and a State's graphs must agree on, besides the cache
# size (checked first, with its own message), the ALiBi slopes and the device; not the capture
# limit, which the State's lengths check applies
SPEC_FIELDS_COMPARED = ("num_heads", "num_kv_heads", "head_size", "dtype", "cache_dtype", "softmax_scale",
                        "sliding_window", "logits_soft_cap", "attn_type")


def spec_differences(got: AttentionSpec, want: AttentionSpec) -> list[str]:
    """'field got vs want' for each of SPEC_FIELDS_COMPARED where the specs differ, and 'alibi_slopes'."""
    differ = [f"{name} {getattr(got, name)} vs {getattr(want, name)}" for name in SPEC_FIELDS_COMPARED
              if getattr(got, name) != getattr(want, name)
              and not (name == "softmax_scale" and math.isclose(got.softmax_scale, want.softmax_scale, rel_tol=1e-6))]
    a, b = got.alibi_slopes, want.alibi_slopes
    if (a is None) != (b is None) or (a is not b and a is not None and not torch.equal(a.cpu(), b.cpu())):
        differ.append("alibi_slopes")
    return differ


def check_graph_step(md: Any, spec: AttentionSpec, backend_name: str, batch_size: int, device: torch.device) -> None:
    """A step that a decode graph captured for `spec` and `batch_size` can replay: checked by every
    State before it copies the step into its static buffers (nothing is checked at replay, so a
    slot or block beyond the cache would be read or written out of bounds). The block ids are
    checked on the host arrays `build()` copied to the device, with the builder's own checks."""
    check_metadata(md, backend_name)
    if md.num_prefills:
        raise ValueError(f"graphs replay decode-only steps; this one has {md.num_prefills} prefills: run it eagerly")
    if not 1 <= md.num_seqs <= batch_size:
        raise ValueError(f"{md.num_seqs} decodes do not fit the graph of batch size {batch_size}: run it eagerly")
    # Metadata not made by build() (`dataclasses.replace`) may carry lengths its other fields and
    # frozen tables were never checked with: its lengths, and tables, are checked here.
    own = getattr(md, "_builder", None) is not None
    longest = md.longest_seq_len if own else max(
        int(np.max(md.seq_lens)), int(np.max(md.encoder_seq_lens)) if md.encoder_seq_lens is not None else 0)
    if longest > spec.max_seq_len_to_capture:
        raise ValueError(f"a sequence of {longest} tokens > spec.max_seq_len_to_capture="
                         f"{spec.max_seq_len_to_capture}: run this step eagerly")
    if (md.num_blocks, md.block_size) != (spec.num_blocks, spec.block_size):
        raise ValueError(f"metadata for num_blocks={md.num_blocks}, block_size={md.block_size} does not match "
                         f"the state's spec ({spec.num_blocks}, {spec.block_size})")
    # A replay runs the layers on the State's own metadata, so what the step's spec says (a
    # window its rolled tables assume, FlashInfer's planned scale) is seen by nothing else.
    differences = [] if md.spec is spec else spec_differences(md.spec, spec)
    if differences:
        raise ValueError(f"metadata built for another spec than the state's ({'; '.join(differences)}): build the "
                         "step with a builder of the state's spec")
    # md.device, md.has, md.is_uploaded: a replay reads the host arrays only, so nothing here uploads the step
    if md.device != device:
        raise ValueError(f"metadata on {md.device}, graph buffers on {device}")
    tables = (("block_tables", md.seq_lens),) + (
        (("cross_block_tables", md.encoder_seq_lens),) if md.has("cross_block_tables") else ())
    for name, lens in tables:
        host = getattr(md, f"{name}_host", None)
        # a table waiting for the upload is uploaded from this host table (`build`)
        if host is None or (md.is_uploaded(name) and tuple(host.shape) != tuple(getattr(md, name).shape)):
            raise ValueError(f"{backend_name} graphs replay metadata from {backend_name}'s builder (its {name} "
                             "with the host copy they were made from)")
        if host.flags.writeable or not own:  # the builder freezes the tables it checked with its lengths
            rolled = md.rolled_blocks if name == "block_tables" else None
            check_table_array(host, lens, spec.block_size, spec.num_blocks, name, rolled)  # rows: one per request
        checked = getattr(md, f"{name}_checked", None)
        if not own and checked is not None:  # replaced lengths: within the entries build() checked, the rest pads
            need = -(-np.asarray(lens, dtype=np.int64) // spec.block_size)
            over = np.nonzero(need > checked)[0]
            if over.size:
                i = int(over[0])
                raise ValueError(f"{name}: request {i} of {int(np.asarray(lens)[i])} tokens needs {int(need[i])} "
                                 f"blocks, but its row holds the {int(checked[i])} that build() checked (metadata "
                                 "copied with other lengths): build the step again")
    if not own:
        _check_copied_decode(md, spec)


def _check_copied_decode(md: Any, spec: AttentionSpec) -> None:
    """What `build()` checks of a decode step and a copy with other lengths (`dataclasses.replace`)
    may have lost: one new token per request, whose slot lies inside its table; with rolling
    tables, every block its window reads still held; and no block that another request names
    written (shared prefix blocks are read-only)."""
    seq = np.asarray(md.seq_lens, dtype=np.int64)
    query = np.asarray(md.query_lens, dtype=np.int64)
    if seq.shape != query.shape or (query != 1).any() or (seq < 1).any():
        raise ValueError(f"a decode graph replays one new token per request (query_lens 1, seq_lens >= 1), got "
                         f"seq_lens {reprlib.repr(md.seq_lens)} and query_lens {reprlib.repr(md.query_lens)} "
                         "(metadata copied with other lengths): build the step again")
    rolled = md.rolled_blocks
    if rolled is not None:
        reads = rolled_blocks(seq - 1, spec.sliding_window, spec.block_size)  # what each window reads from
        early = np.nonzero(reads < rolled)[0]
        if early.size:
            i = int(early[0])
            raise ValueError(f"block_tables: request {i}'s window reads from block entry {int(reads[i])}, but its "
                             f"table freed the first {int(rolled[i])} (metadata copied with other lengths): build "
                             "the step again")
    need = -(-seq // spec.block_size)
    ids = live_entries(md.block_tables_host, need, rolled)[1]
    if ids.size and np.unique(ids).size < ids.size:  # a block named twice: is it written?
        row_ends = np.cumsum(need if rolled is None else need - rolled)
        check_written_blocks(md.host_arrays()["slot_mapping"], [1] * seq.size, ids, row_ends, spec.block_size,
                             "block_tables")


# ---------------------------------------------------------------------------------------------
# Block copies and swaps


def check_cache_list(kv_caches: object) -> None:
    """A list (or tuple) of cache tensors. (Every runner step checks it: a map, not a generator,
    halves its cost over a model's layers.)"""
    if not isinstance(kv_caches, list | tuple) or not all(
            map(isinstance, kv_caches, itertools.repeat(torch.Tensor, len(kv_caches)))):
        raise ValueError(f"kv_caches must be a list of cache tensors, got {type(kv_caches).__name__}")


def check_block_op_args(kv_caches: object, pairs: object, what: str = "kv_caches") -> None:
    """Python types of copy_blocks / swap_blocks arguments, before the op's dispatcher sees them."""
    if what == "kv_caches":
        check_cache_list(kv_caches)
    else:
        _tensor(what, kv_caches)
    if not isinstance(pairs, torch.Tensor):
        raise ValueError(f"block pairs must be an int64 tensor [N, 2] of (src, dst), got {type(pairs).__name__}")


def check_block_cache(cache: object, what: str) -> torch.Tensor:
    """A cache the block ops can index: [2, num_blocks, block_size, num_kv_heads, head_size]."""
    cache = _tensor(what, cache)
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(
            f"{what} must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(cache.shape)}"
        )
    return cache


def check_block_pairs(pairs: object, src_cache: torch.Tensor, dst_cache: torch.Tensor) -> None:
    """int64 [N, 2] of (src, dst) block ids; on the host, ids inside each cache and no destination
    named twice (the copy would be racy). Pairs on the GPU are not read: that would sync."""
    if not isinstance(pairs, torch.Tensor) or pairs.dtype != torch.int64 or pairs.dim() != 2 or pairs.shape[1] != 2:
        desc = f"{pairs.dtype} {tuple(pairs.shape)}" if isinstance(pairs, torch.Tensor) else type(pairs).__name__
        raise ValueError(f"block pairs must be an int64 tensor [N, 2] of (src, dst), got {desc}")
    if pairs.device.type != "cpu" or not pairs.numel():
        return
    for col, cache in ((0, src_cache), (1, dst_cache)):
        ids = pairs[:, col]
        if int(ids.min()) < 0 or int(ids.max()) >= cache.shape[1]:
            raise ValueError(
                f"{('src', 'dst')[col]} block ids {ids.tolist()} outside the cache's 0..{cache.shape[1] - 1}"
            )
    dst = pairs[:, 1]
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError(f"dst block ids {dst.tolist()} name a block twice: each destination gets one source")

"""Paged-KV bookkeeping: cache blocks per request, and the steps of a continuous-batching server.

Two levels:

- `BlockAllocator`, `Request`, `schedule`: hand out blocks and turn a fixed batch into the
  (seq_lens, query_lens, block_tables) a builder takes, plus ids / positions (the demo, the soak
  driver, tests and benchmarks).
- `Scheduler`: what a server runs. Requests arrive with `add_request` at any time; each
  `schedule()` makes one step of decodes (one token each) and prompt chunks under a token budget
  (chunked prefill), admitting waiting requests while others decode. It keeps one block table
  per layer group: a sliding-window group's table rolls (the blocks its window has left behind go
  back to the free list, so its memory stops growing with the context). `update()` takes the
  sampled tokens and frees every block of a finished request (EOS or max_new_tokens).
  Admission reserves a request's worst case in every group, so a running request never runs out
  of blocks (no preemption needed). Each running request owns a slot: its row of one persistent
  table array per group, which a step gathers at once (no per-request copy of its table).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import reprlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from compiled_attn.validation import as_int, holds_a_bool

ROLLED = -1  # a rolling table's entry whose block went back to the free list (builders ignore it)
NULL_BLOCK = 0  # never handed out by an allocator that reserves it: rolled entries and graph pads read it


class BlockAllocator:
    """Hands out cache blocks from a free list; raises when the cache is full.

    `reserve_null_block`: never hand out block 0 (NULL_BLOCK), which builders put in place of
    rolled table entries and graph States read for pad rows: its owner keeps it finite (zeroes),
    so that masked keys read there are 0 * finite, never NaN."""

    def __init__(self, num_blocks: int, block_size: int, *, reserve_null_block: bool = False) -> None:
        self.block_size = as_int("block_size", block_size)
        self.num_blocks = as_int("num_blocks", num_blocks)
        self.free = list(range(self.num_blocks - 1, NULL_BLOCK if reserve_null_block else -1, -1))
        self.num_usable = len(self.free)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` until it holds `num_tokens` tokens."""
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self.free):
            raise RuntimeError(f"KV cache full: need {need} more blocks, {len(self.free)} free")
        for _ in range(need):
            table.append(self.free.pop())

    def release(self, table: list[int]) -> None:
        self.free.extend(reversed(table))
        table.clear()


@dataclasses.dataclass
class Request:
    tokens: list[int]  # every token so far (prompt + generated)
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = dataclasses.field(default_factory=list)


def schedule(requests: list[Request], allocator: BlockAllocator, device: torch.device | str):
    """One step over `requests` (prefills must come first): every uncomputed token is fed.

    Returns (seq_lens, query_lens, block_tables, input_ids [num_tokens], positions [num_tokens]).
    """
    seq_lens, query_lens, ids, pos = [], [], [], []
    for r in requests:
        n = len(r.tokens)
        allocator.grow(r.block_table, n)
        seq_lens.append(n)
        query_lens.append(n - r.num_computed)
        ids.extend(r.tokens[r.num_computed :])
        pos.extend(range(r.num_computed, n))
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    positions = torch.tensor(pos, dtype=torch.int64, device=device)
    return seq_lens, query_lens, [r.block_table for r in requests], input_ids, positions


def last_token_rows(query_lens: list[int]) -> list[int]:
    """Row of each request's last token in the flat batch (where its next-token logits are)."""
    rows, at = [], -1
    for q in query_lens:
        at += q
        rows.append(at)
    return rows


# ---------------------------------------------------------------------------------------------
# Continuous batching


def eos_ids(eos_token_id: object) -> frozenset[int]:
    """A request's stop tokens: None (none), one id (an int, a numpy int, a 0-d tensor) or several."""
    if eos_token_id is None:
        return frozenset()
    try:
        many = list(eos_token_id)
    except TypeError:  # a scalar
        many = [eos_token_id]
    return frozenset(as_int("eos_token_id", t, minimum=0) for t in many)


@dataclasses.dataclass
class ServedRequest:
    """One request of a `Scheduler`: its tokens, progress and per-group block tables."""

    request_id: int
    prompt_len: int
    tokens: list[int]  # prompt, then the generated tokens
    max_new_tokens: int
    eos_token_id: frozenset[int]
    tables: dict[str, list[int]]  # group -> blocks from position 0 on (ROLLED where freed)
    reserved: dict[str, int]  # group -> most blocks it can hold at once (reserved at admission)
    num_computed: int = 0  # tokens whose K/V are in the caches
    finish_reason: str | None = None  # "eos" or "length" once finished
    slot: int = -1  # its row of the scheduler's table arrays while running

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class ScheduledStep:
    """One step's batch, prefills (and prompt chunks) first, then decodes: what a builder and the
    model take. Tables are int32 [num_seqs, max blocks needed] per layer group, ROLLED where a
    sliding-window group freed the block (builders of window specs ignore those entries)."""

    requests: list[ServedRequest]
    seq_lens: np.ndarray  # int64 [num_seqs]
    query_lens: np.ndarray  # int64 [num_seqs]
    block_tables: dict[str, np.ndarray]
    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    sample_rows: list[int]  # rows (in the flat batch) whose logits give a request its next token
    sampled: list[ServedRequest]  # the requests those rows belong to, in the same order


_MAX_TOKEN_ID = np.iinfo(np.int64).max  # the steps' input_ids are int64


def _is_token_id(token: object) -> bool:
    """Whether a sampled token is an id: an int >= 0 that fits int64 (a float, a negative id or a
    tensor of several would be fed as is; a bool, which operator.index takes, as token 0 or 1)."""
    if holds_a_bool((token,)):
        return False
    try:
        return 0 <= operator.index(token) <= _MAX_TOKEN_ID
    except TypeError:
        return False


def window_blocks(sliding_window: int, max_query_len: int, block_size: int) -> int:
    """The most blocks a rolling table holds at once: the window before a step's first new token
    plus the step's tokens, over at most one partial block at each end."""
    return -(-(sliding_window - 1 + max_query_len) // block_size) + 1


def _is_decode(r: ServedRequest, query_len: int) -> bool:
    """Whether `query_len` new tokens of `r` make a decode as the builders classify it: one token
    after some computed ones (a 1-token chunk of a cached prompt included)."""
    return query_len == 1 and r.num_computed > 0


class Scheduler:
    """Continuous batching over paged KV caches with one block table per layer group.

    Args:
        num_blocks, block_size: the groups' cache geometry (one allocator per group; block 0 is
            reserved, see `BlockAllocator`); num_blocks may differ per group ({group: n}).
        group_windows: group name -> its sliding window W (the group's tables roll) or None.
        max_num_seqs: the most requests in one step.
        max_num_batched_tokens: the most tokens in one step; longer prompts are split into
            chunks (chunked prefill). Decodes are scheduled first, one token each.
        vocab_size: the model's vocabulary (its input embeddings), or None: a prompt with an id at
            or past it is refused when added (the step's embedding would fail on it, after the
            request took its blocks).

    Example::

        sched = Scheduler(num_blocks=1024, block_size=16, group_windows={"full": None, "swa": 4096})
        rid = sched.add_request(prompt, max_new_tokens=32, eos_token_id=2)
        while sched.has_unfinished():
            step = sched.schedule()
            ...  # build one metadata per group from step.seq_lens, step.query_lens, step.block_tables[g]
            sched.update(step, next_tokens)   # one token per step.sample_rows entry
    """

    def __init__(self, *, num_blocks: int | Mapping[str, int], block_size: int,
                 group_windows: Mapping[str, int | None],
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, vocab_size: int | None = None) -> None:
        if not group_windows:
            raise ValueError("group_windows needs at least one group")
        max_num_seqs = as_int("max_num_seqs", max_num_seqs, minimum=None)
        max_num_batched_tokens = as_int("max_num_batched_tokens", max_num_batched_tokens, minimum=None)
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs} and "
                             f"{max_num_batched_tokens}")
        self.block_size = as_int("block_size", block_size)
        try:
            windows = dict(group_windows)
        except (TypeError, ValueError):
            raise ValueError("group_windows must map group names to windows (int or None), got "
                             f"{group_windows!r}") from None
        self.windows = {g: None if w is None else as_int(f"group_windows[{g!r}]", w) for g, w in windows.items()}
        if isinstance(num_blocks, Mapping) and set(num_blocks) != set(self.windows):
            raise ValueError(f"num_blocks names the groups {sorted(num_blocks)} but group_windows "
                             f"{sorted(self.windows)}: give every group its number of blocks")
        # a group's own count is named by its group; one count for all is checked as `num_blocks`
        blocks = ({g: as_int(f"num_blocks[{g!r}]", n) for g, n in num_blocks.items()} if isinstance(num_blocks, Mapping)
                  else dict.fromkeys(self.windows, num_blocks))
        self.allocators = {g: BlockAllocator(blocks[g], self.block_size, reserve_null_block=True) for g in self.windows}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = None if vocab_size is None else as_int("vocab_size", vocab_size)
        self.waiting: deque[ServedRequest] = deque()
        self.running: list[ServedRequest] = []  # in admission order (never more than max_num_seqs)
        self._ids = itertools.count()
        self._outstanding = dict.fromkeys(self.windows, 0)  # reserved blocks not yet held
        # Per slot (a running request's `slot`): its tables mirrored in one int32 array per group
        # (0 past the blocks held; widened when a request outgrows it), which a step gathers at
        # once; for window groups, how many leading entries are ROLLED; and the two thresholds
        # past which `_allocate` has work: tokens every table has room for, and the first new
        # token at which a window group rolls a block. A step compares two ints per request.
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._tables = {g: np.zeros((max_num_seqs, 0), dtype=np.int32) for g in self.windows}
        self._rolled = {g: [0] * max_num_seqs for g, w in self.windows.items() if w is not None}
        self._room: list[float] = [0] * max_num_seqs
        self._roll_at: list[float] = [math.inf] * max_num_seqs

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | None = None) -> int:
        """Queue a request; returns its id. ValueError for one that could never be served."""
        return self.add_requests([prompt], max_new_tokens, eos_token_id)[0]

    def add_requests(self, prompts: Iterable[Sequence[int]], max_new_tokens: int,
                     eos_token_id: int | Sequence[int] | None = None) -> list[int]:
        """Queue requests, all or none: each is checked before any is queued (ValueError naming
        the first that could never be served); returns their ids in order."""
        max_new_tokens = as_int("max_new_tokens", max_new_tokens)
        eos = eos_ids(eos_token_id)
        prompts = list(prompts)  # a generator, say: counted below
        checked = []
        for i, prompt in enumerate(prompts):
            try:
                checked.append(self._admissible(prompt, max_new_tokens))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}" if len(prompts) > 1 else str(e)) from None
        ids = []
        for tokens, reserved in checked:
            request = ServedRequest(next(self._ids), len(tokens), tokens, max_new_tokens, eos,
                                    {g: [] for g in self.windows}, reserved)
            self.waiting.append(request)
            ids.append(request.request_id)
        return ids

    def _admissible(self, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], dict[str, int]]:
        """The prompt's tokens and the blocks per group it reserves; ValueError for a prompt that
        is not token ids or a request no cache could hold."""
        # a bool among ints would become an int64 array (True as token 1): refused as a bool alone is
        tokens = None if isinstance(prompt, list | tuple) and holds_a_bool(prompt) else np.asarray(
            prompt.cpu() if isinstance(prompt, torch.Tensor) else prompt)
        if tokens is not None and tokens.ndim == 1 and not tokens.size:
            raise ValueError("a prompt needs at least one token")
        if (tokens is None or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or tokens.min() < 0
                or tokens.max() > _MAX_TOKEN_ID):
            raise ValueError(f"a prompt is a sequence of token ids (ints >= 0 that fit int64), got "
                             f"{reprlib.repr(prompt)}")
        if self.vocab_size is not None and tokens.max() >= self.vocab_size:
            raise ValueError(f"token id {tokens.max()} is past the model's vocabulary of {self.vocab_size} (its input "
                             "embeddings): tokenize with the model's own tokenizer")
        longest = tokens.size + max_new_tokens - 1  # the last token is sampled, never fed
        reserved = {g: self._most_blocks(g, longest, tokens.size) for g in self.windows}
        for g, need in reserved.items():
            if need > self.allocators[g].num_usable:
                raise ValueError(f"a request of {tokens.size} prompt + {max_new_tokens} new tokens needs up to {need} "
                                 f"blocks of group {g!r}, the cache has {self.allocators[g].num_usable}: raise "
                                 "num_blocks or shorten the request")
        return tokens.tolist(), reserved

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_in_use(self) -> dict[str, int]:
        """Per group, blocks held by requests now."""
        return {g: a.num_usable - a.num_free for g, a in self.allocators.items()}

    def _most_blocks(self, group: str, longest: int, prompt_len: int) -> int:
        full = -(-longest // self.block_size)
        window = self.windows[group]
        if window is None:
            return full
        chunk = min(prompt_len, self.max_num_batched_tokens)
        return min(full, window_blocks(window, chunk, self.block_size))

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when no request has work. Decodes first (one token each), then
        running prompts' next chunks, then waiting requests admitted while the token budget,
        max_num_seqs and every group's free blocks (their worst case reserved) allow."""
        budget = self.max_num_batched_tokens
        # prefills before decodes, as builders classify them (a 1-token chunk of a cached prompt is a decode)
        ready: list[ServedRequest] = []  # running requests whose next token is a decode: first served
        rest: list[ServedRequest] = []
        for r in self.running:
            (ready if _is_decode(r, len(r.tokens) - r.num_computed) else rest).append(r)
        taken = min(len(ready), self.max_num_seqs, budget)
        decodes = [(r, 1) for r in ready[:taken]]
        budget -= taken
        prompts: list[tuple[ServedRequest, int]] = []
        for r in rest:  # then prompt chunks, while seats and tokens are left
            if len(prompts) + len(decodes) == self.max_num_seqs or budget == 0:
                break
            q = min(len(r.tokens) - r.num_computed, budget)
            (decodes if _is_decode(r, q) else prompts).append((r, q))
            budget -= q
        while (self.waiting and len(prompts) + len(decodes) < self.max_num_seqs and budget > 0
               and self._fits(self.waiting[0])):
            r = self.waiting.popleft()
            for g, n in r.reserved.items():
                self._outstanding[g] += n
            r.slot = self._free_slots.pop()
            self._room[r.slot] = 0  # no blocks yet: its first step allocates
            self.running.append(r)
            q = min(len(r.tokens), budget)
            prompts.append((r, q))  # nothing computed yet: never a decode
            budget -= q
        if not prompts and not decodes:
            return None
        return self._step(prompts + decodes)

    def _fits(self, r: ServedRequest) -> bool:
        return all(self.allocators[g].num_free - self._outstanding[g] >= n for g, n in r.reserved.items())

    def _allocate(self, r: ServedRequest, seq_len: int) -> None:
        """Roll each window group's table to the step's first new token, then grow every table to
        `seq_len` tokens (from the request's reservation); the slot's table rows follow, and its
        thresholds for the next call."""
        room, roll_at = math.inf, math.inf
        for g, table in r.tables.items():
            allocator, window, row = self.allocators[g], self.windows[g], self._tables[g][r.slot]
            if window is not None:
                rolled = self._rolled[g][r.slot]  # entries before it are ROLLED already
                first = max(r.num_computed - window + 1, 0) // self.block_size
                for i in range(rolled, first):
                    allocator.free.append(table[i])
                    table[i] = ROLLED
                    self._outstanding[g] += 1
                if first > rolled:
                    row[rolled:first] = ROLLED
                    self._rolled[g][r.slot] = rolled = first
                # the first new token from which block `rolled` is wholly before the window
                roll_at = min(roll_at, (rolled + 1) * self.block_size + window - 1)
            held = len(table)
            allocator.grow(table, seq_len)
            self._outstanding[g] -= len(table) - held
            if len(table) > row.size:
                row = self._widen(g, len(table))[r.slot]
            row[held:len(table)] = table[held:]
            room = min(room, len(table) * self.block_size)
        self._room[r.slot], self._roll_at[r.slot] = room, roll_at

    def _widen(self, group: str, width: int) -> np.ndarray:
        """Group `group`'s table array with room for `width` blocks a row (doubling: rarely)."""
        old = self._tables[group]
        wider = np.zeros((old.shape[0], max(width, 2 * old.shape[1])), dtype=np.int32)
        wider[:, :old.shape[1]] = old
        self._tables[group] = wider
        return wider

    def _step(self, batch: list[tuple[ServedRequest, int]]) -> ScheduledStep:
        """Allocate what the batch's rows need and lay the step out. One pass of scalar Python
        per row (cheaper than a numpy call per row, or than numpy on small batches), a few
        numpy calls per step; each group's tables are one gather from its array."""
        requests, slots, seq_lens, query_lens, ids, positions, rows, sampled = [], [], [], [], [], [], [], []
        num_tokens = 0
        for r, q in batch:
            start, slot = r.num_computed, r.slot
            if start + q > self._room[slot] or start >= self._roll_at[slot]:  # a block to add or to roll
                self._allocate(r, start + q)
            requests.append(r)
            slots.append(slot)
            seq_lens.append(start + q)
            query_lens.append(q)
            if q == 1:
                ids.append(r.tokens[start])
                positions.append(start)
            else:
                ids += r.tokens[start:start + q]
                positions += range(start, start + q)
            num_tokens += q
            if start + q == len(r.tokens):  # its last token is fed: the row's logits sample the next
                rows.append(num_tokens - 1)
                sampled.append(r)
        width = -(-max(seq_lens) // self.block_size)
        tables = {g: t[slots, :width] for g, t in self._tables.items()}  # copies: later steps edit the arrays
        return ScheduledStep(requests, np.array(seq_lens, dtype=np.int64), np.array(query_lens, dtype=np.int64),
                             tables, np.array(ids, dtype=np.int64), np.array(positions, dtype=np.int64), rows, sampled)

    def update(self, step: ScheduledStep, next_tokens: Sequence[int]) -> list[ServedRequest]:
        """Record a step: its tokens are now cached, and each of `step.sampled` gets its token from
        `next_tokens` (one per `step.sample_rows` entry). Returns the requests that finished;
        their blocks are free again. ValueError, with nothing recorded, for a wrong token count,
        a token that is not an id (an int >= 0 that fits int64), or a step that is not each of
        its requests' next (recorded already, or an older one after a newer)."""
        if len(next_tokens) != len(step.sampled):
            raise ValueError(f"update() needs {len(step.sampled)} tokens (one per sample row), got {len(next_tokens)}")
        # everything checked before anything is recorded: a refused update leaves the scheduler as it was
        # (C-speed scans: this runs every step)
        try:
            tokens = list(map(operator.index, next_tokens))
        except TypeError:
            tokens = None
        if (tokens is None or (tokens and (min(tokens) < 0 or max(tokens) > _MAX_TOKEN_ID))
                or holds_a_bool(next_tokens if isinstance(next_tokens, list | tuple) else list(next_tokens))):
            bad = next(t for t in next_tokens if not _is_token_id(t))
            raise ValueError(f"update() takes token ids (ints >= 0 that fit int64), got {reprlib.repr(bad)}")
        query_lens = step.query_lens.tolist()
        for r, seq_len, q in zip(step.requests, step.seq_lens.tolist(), query_lens, strict=True):
            if r.num_computed != seq_len - q:
                raise ValueError(f"this step feeds request {r.request_id} from position {seq_len - q}, but it has "
                                 f"{r.num_computed} tokens computed: record each step once, in the order "
                                 "schedule() made them")
        for r, q in zip(step.requests, query_lens, strict=True):
            r.num_computed += q
        finished = []
        for r, token in zip(step.sampled, tokens, strict=True):
            r.tokens.append(token)
            if token in r.eos_token_id:
                r.finish_reason = "eos"
            elif len(r.tokens) - r.prompt_len >= r.max_new_tokens:
                r.finish_reason = "length"
            else:
                continue
            self._free(r)
            finished.append(r)
        return finished

    def _free(self, r: ServedRequest) -> None:
        self.running.remove(r)
        for g, table in r.tables.items():
            held = [b for b in table if b != ROLLED]
            self.allocators[g].free.extend(reversed(held))
            self._outstanding[g] -= r.reserved[g] - len(held)
            table.clear()
            self._tables[g][r.slot] = 0
            if g in self._rolled:
                self._rolled[g][r.slot] = 0
        self._free_slots.append(r.slot)
        r.slot = -1

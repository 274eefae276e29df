"""The public scheduler (`compiled_attn.paging.Scheduler`): admission while others decode, chunked
prefill, blocks freed on finish, rolling tables for sliding-window groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compiled_attn as ca
from compiled_attn.paging import NULL_BLOCK, ROLLED, BlockAllocator, Scheduler, window_blocks


def drive(sched: Scheduler, token: int = 7, on_step=None) -> int:
    """Run the scheduler to the end, feeding `token` as every sampled token; returns the steps."""
    steps = 0
    while sched.has_unfinished():
        step = sched.schedule()
        if on_step is not None:
            on_step(step)
        sched.update(step, [token] * len(step.sample_rows))
        steps += 1
    return steps


def test_admits_waiting_requests_while_others_decode():
    sched = Scheduler(num_blocks=64, block_size=4, group_windows={"full": None}, max_num_batched_tokens=16)
    a = sched.add_request([1] * 5, max_new_tokens=4)
    first = sched.schedule()
    sched.update(first, [9])
    b = sched.add_request([2] * 3, max_new_tokens=2)
    step = sched.schedule()
    # the newcomer's prompt comes first (prefills before decodes), the running request decodes
    assert [r.request_id for r in step.requests] == [b, a]
    assert step.query_lens.tolist() == [3, 1] and step.seq_lens.tolist() == [3, 6]
    assert step.input_ids.tolist() == [2, 2, 2, 9] and step.positions.tolist() == [0, 1, 2, 5]
    assert step.sample_rows == [2, 3]


def test_long_prompts_are_chunked_under_the_token_budget():
    sched = Scheduler(num_blocks=64, block_size=4, group_windows={"full": None}, max_num_batched_tokens=8)
    sched.add_request(list(range(20)), max_new_tokens=2)
    chunks = []
    drive(sched, on_step=lambda s: chunks.append((s.query_lens.tolist(), s.sample_rows)))
    assert chunks == [([8], []), ([8], []), ([4], [3]), ([1], [0])]


def test_add_requests_queues_all_or_none():
    """A batch with one request no cache could hold raises, naming it, before any is queued."""
    sched = Scheduler(num_blocks=8, block_size=4, group_windows={"full": None})
    with pytest.raises(ValueError, match=r"prompts\[2\]: a request of 40 prompt \+ 2 new tokens needs up to 11 blocks"):
        sched.add_requests([[1, 2, 3], [4, 5], list(range(40))], max_new_tokens=2)
    assert not sched.has_unfinished() and sched.blocks_in_use() == {"full": 0}
    ids = sched.add_requests([[1, 2, 3], [4, 5]], max_new_tokens=2)
    assert [r.request_id for r in sched.waiting] == ids and len(set(ids)) == 2


@pytest.mark.parametrize(("kw", "match"), [
    ({"max_new_tokens": 2.5}, "max_new_tokens must be an int"),
    ({"max_new_tokens": "3"}, "max_new_tokens must be an int"),
    ({"max_new_tokens": None}, "max_new_tokens must be an int"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"eos_token_id": 2.0}, "eos_token_id must be an int"),
    ({"eos_token_id": [3, "x"]}, "eos_token_id must be an int"),
    ({"prompt": [1, 2.5]}, "a prompt is a sequence of token ids"),
    ({"prompt": [1, -2]}, "a prompt is a sequence of token ids"),
    ({"prompt": [[1, 2]]}, "a prompt is a sequence of token ids"),
    ({"prompt": [5, True]}, "a prompt is a sequence of token ids"),  # not token 1
    ({"prompt": (np.bool_(False), 3)}, "a prompt is a sequence of token ids"),
    ({"prompt": [5, torch.tensor(True)]}, "a prompt is a sequence of token ids"),
    ({"prompt": [5, np.array(True)]}, "a prompt is a sequence of token ids"),
    ({"prompt": []}, "a prompt needs at least one token"),
], ids=repr)
def test_requests_of_the_wrong_type_are_a_value_error(kw, match):
    sched = Scheduler(num_blocks=8, block_size=4, group_windows={"full": None})
    args = {"prompt": [1, 2, 3], "max_new_tokens": 2, **kw}
    with pytest.raises(ValueError, match=match):
        sched.add_request(**args)
    assert not sched.has_unfinished()


def test_a_generator_of_prompts_is_checked_and_queued_like_a_list():
    sched = Scheduler(num_blocks=16, block_size=4, group_windows={"full": None})
    with pytest.raises(ValueError, match=r"^prompts\[1\]: a prompt is a sequence of token ids"):
        sched.add_requests(iter([[1], [-1]]), 2)
    assert not sched.has_unfinished()
    sched.add_requests(iter([[1, 2], [3]]), 2)
    assert [r.tokens for r in sched.waiting] == [[1, 2], [3]]


def test_numpy_and_tensor_ids_are_ints():
    """A numpy int or 0-d tensor is one stop token; a prompt may be an array or a tensor."""
    sched = Scheduler(num_blocks=16, block_size=4, group_windows={"full": None})
    a = sched.add_request(np.array([1, 2, 3]), max_new_tokens=np.int64(5), eos_token_id=np.int64(7))
    b = sched.add_request(torch.tensor([4, 5]), max_new_tokens=5, eos_token_id=torch.tensor(9))
    assert [(r.tokens, r.eos_token_id) for r in sched.waiting] == [([1, 2, 3], frozenset({7})),
                                                                  ([4, 5], frozenset({9}))]
    step = sched.schedule()
    finished = sched.update(step, [7, 9])
    assert sorted(r.request_id for r in finished) == sorted([a, b])


def test_blocks_are_freed_on_eos_and_on_length():
    sched = Scheduler(num_blocks=32, block_size=4, group_windows={"full": None})
    free = sched.allocators["full"].num_free
    eos = sched.add_request([1, 2, 3], max_new_tokens=100, eos_token_id=5)
    length = sched.add_request([1, 2, 3, 4, 5, 6], max_new_tokens=3)
    step = sched.schedule()
    assert sched.blocks_in_use() == {"full": 1 + 2}
    finished = sched.update(step, [5, 8])
    assert [(r.request_id, r.finish_reason) for r in finished] == [(eos, "eos")]
    assert sched.blocks_in_use() == {"full": 2}
    (last,) = [r for r in sched.running if r.request_id == length]
    drive(sched)
    assert last.finish_reason == "length" and last.output_tokens == [8, 7, 7]
    assert sched.running == [] and sched.allocators["full"].num_free == free
    assert NULL_BLOCK not in sched.allocators["full"].free  # reserved: never handed out


def test_admission_waits_for_the_worst_case_blocks():
    sched = Scheduler(num_blocks=9, block_size=4, group_windows={"full": None})  # 8 usable
    sched.add_request([1] * 8, max_new_tokens=9)  # up to 16 tokens fed: 4 blocks reserved
    sched.add_request([1] * 8, max_new_tokens=9)
    late = sched.add_request([1] * 4, max_new_tokens=1)
    step = sched.schedule()
    assert late not in [r.request_id for r in step.requests]  # 4 + 4 reserved, nothing left
    with pytest.raises(ValueError, match="raise num_blocks"):
        sched.add_request([1] * 40, max_new_tokens=1)


def test_sliding_window_tables_roll_and_stop_growing():
    """Goal of issue 15: decoding at ctx 8192 with window 4096, a window group holds <= 55 % of a
    full group's blocks (while a prompt chunk of C tokens is in flight it holds up to W + C tokens'
    worth: `window_blocks`)."""
    bs, window, ctx, chunk = 16, 4096, 8192, 512
    sched = Scheduler(num_blocks=2 * ctx // bs + 2, block_size=bs, group_windows={"full": None, "swa": window},
                      max_num_batched_tokens=chunk)
    sched.add_request(list(range(ctx - 64)), max_new_tokens=65)
    peak = {"full": 0, "swa": 0}
    at_ctx = {}

    def check(step):
        for g, n in sched.blocks_in_use().items():
            peak[g] = max(peak[g], n)
        table, seq = step.block_tables["swa"][0], int(step.seq_lens[0])
        first = max(seq - int(step.query_lens[0]) - window + 1, 0) // bs
        assert (table[:first] == ROLLED).all() and (table[first: -(-seq // bs)] >= 1).all()
        if seq == ctx:
            at_ctx.update(sched.blocks_in_use())

    drive(sched, on_step=check)
    assert at_ctx["full"] == ctx // bs
    assert at_ctx["swa"] <= 0.55 * at_ctx["full"], at_ctx
    assert peak["swa"] <= window_blocks(window, chunk, bs) < peak["full"]


def test_a_rolling_builder_ignores_what_the_window_left_behind():
    spec = ca.AttentionSpec(num_heads=2, num_kv_heads=1, head_size=8, block_size=4, num_blocks=16, dtype=torch.float32,
                            device="cpu", sliding_window=5)
    builder = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(spec, rolling_tables=True)
    # request 0 decodes at position 12: its window 8..12 starts in block 2, blocks 0 and 1 rolled away
    table = np.array([[ROLLED, ROLLED, 3, 4], [5, 6, 0, 0]], dtype=np.int32)
    md = builder.build([6, 13], [6, 1], table[[1, 0]])
    assert md.rolled_blocks.tolist() == [0, 2]
    assert md.block_tables_host.tolist() == [[5, 6, 0, 0], [0, 0, 3, 4]]
    with pytest.raises(ValueError, match="rolling_tables=True needs"):
        ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(
            ca.AttentionSpec(num_heads=2, num_kv_heads=1, head_size=8, block_size=4, num_blocks=16,
                             dtype=torch.float32, device="cpu"), rolling_tables=True)


def test_groups_may_have_caches_of_different_sizes():
    sched = Scheduler(num_blocks={"full": 32, "swa": 6}, block_size=4, group_windows={"full": None, "swa": 4},
                      max_num_batched_tokens=8)
    assert {g: a.num_usable for g, a in sched.allocators.items()} == {"full": 31, "swa": 5}
    # 8-token chunks: the window group never holds more than window_blocks(4, 8, 4) = 4 blocks
    sched.add_request(list(range(40)), max_new_tokens=4)
    drive(sched)
    assert sched.blocks_in_use() == {"full": 0, "swa": 0}


def test_block_counts_must_name_every_group():
    with pytest.raises(ValueError, match="every group"):
        Scheduler(num_blocks={"full": 64}, block_size=4, group_windows={"full": None, "window8": 8})


@pytest.mark.parametrize(("kw", "match"), [
    ({"group_windows": {}}, "^group_windows needs at least one group$"),
    ({"max_num_seqs": 0}, "^max_num_seqs and max_num_batched_tokens must be >= 1, got 0 and 2048$"),
    ({"max_num_batched_tokens": 0}, "^max_num_seqs and max_num_batched_tokens must be >= 1, got 64 and 0$"),
    ({"block_size": 0}, "^block_size must be >= 1, got 0$"),
    ({"block_size": -4}, "^block_size must be >= 1, got -4$"),
    ({"block_size": "4"}, "^block_size must be an int, got '4'$"),
    ({"max_num_seqs": "4"}, "^max_num_seqs must be an int, got '4'$"),
    ({"max_num_seqs": 2.5}, "^max_num_seqs must be an int, got 2.5$"),
    ({"max_num_batched_tokens": None}, "^max_num_batched_tokens must be an int, got None$"),
    ({"group_windows": {"w": 0}}, r"^group_windows\['w'\] must be >= 1, got 0$"),
    ({"group_windows": ["full"]}, r"^group_windows must map group names to windows \(int or None\), got \['full'\]$"),
    ({"num_blocks": {"full": 0}}, r"^num_blocks\['full'\] must be >= 1, got 0$"),
    ({"num_blocks": 0}, "^num_blocks must be >= 1, got 0$"),
], ids=["no_groups", "no_seqs", "no_tokens", "block_zero", "block_negative", "block_str", "seqs_str", "seqs_float",
        "tokens_none", "window_zero", "windows_not_a_mapping", "group_blocks_zero", "blocks_zero"])
def test_scheduler_options_that_could_serve_nothing_or_are_not_ints_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(**{"num_blocks": 8, "block_size": 4, "group_windows": {"full": None}, **kw})


def test_scheduler_takes_group_windows_as_name_window_pairs():
    sched = Scheduler(num_blocks=8, block_size=4, group_windows=[("full", None), ("local", 8)])
    assert sched.windows == {"full": None, "local": 8}


@pytest.mark.parametrize(("args", "match"), [((3, 0), "^block_size must be >= 1"), ((0, 4), "^num_blocks must be >= 1"),
                                             ((3, 4.0), "^block_size must be an int")])
def test_block_allocator_sizes_must_be_positive_ints(args, match):
    with pytest.raises(ValueError, match=match):
        BlockAllocator(*args)


def test_update_with_a_token_per_row_too_few_or_many_raises_and_records_nothing():
    sched = Scheduler(num_blocks=16, block_size=4, group_windows={"full": None})
    sched.add_requests([[1, 2, 3], [4, 5]], max_new_tokens=3)
    step = sched.schedule()
    before = [(r.num_computed, list(r.tokens)) for r in step.requests]
    for tokens in ([7], [7, 8, 9]):
        with pytest.raises(ValueError, match=rf"update\(\) needs 2 tokens \(one per sample row\), got {len(tokens)}"):
            sched.update(step, tokens)
        assert [(r.num_computed, r.tokens) for r in step.requests] == before
    sched.update(step, [7, 8])  # the step is still recorded whole afterwards
    assert [(r.num_computed, r.tokens[-1]) for r in step.requests] == [(3, 7), (2, 8)]


@pytest.mark.parametrize("bad", [None, -5, 7.5, 2**63, torch.tensor([3, 4]), True, torch.tensor(False)])
def test_update_with_a_token_that_is_no_id_raises_and_records_nothing(bad):
    """Every token is checked before anything is recorded, as the count is: a bad second token
    leaves the first request's tokens and both requests' computed counts as they were."""
    sched = Scheduler(num_blocks=16, block_size=4, group_windows={"full": None})
    sched.add_requests([[1, 2, 3], [4, 5]], max_new_tokens=3)
    step = sched.schedule()
    before = [(r.num_computed, list(r.tokens)) for r in step.requests]
    with pytest.raises(ValueError, match=r"^update\(\) takes token ids \(ints >= 0 that fit int64\)"):
        sched.update(step, [7, bad])
    assert [(r.num_computed, r.tokens) for r in step.requests] == before
    sched.update(step, [np.int64(7), torch.tensor(8)])  # numpy and 0-d tensor ids are ids
    assert [(r.num_computed, r.tokens[-1]) for r in step.requests] == [(3, 7), (2, 8)]
    assert drive(sched) == 2  # two more decode steps each, served as usual


def test_a_step_recorded_twice_or_out_of_order_raises_and_records_nothing():
    sched = Scheduler(num_blocks=16, block_size=4, group_windows={"full": None})
    sched.add_requests([[1, 2, 3], [4, 5]], max_new_tokens=3)
    first = sched.schedule()
    stale = sched.schedule()  # the same tokens again: nothing was recorded in between
    sched.update(first, [7, 8])
    for step in (first, stale):
        before = [(r.num_computed, list(r.tokens)) for r in step.requests]
        with pytest.raises(ValueError, match=r"feeds request \d+ from position 0, but it has [23] tokens computed: "
                                             r"record each step once, in the order schedule\(\) made them"):
            sched.update(step, [9, 9])
        assert [(r.num_computed, r.tokens) for r in step.requests] == before
    step = sched.schedule()
    assert step.query_lens.tolist() == [1, 1] and step.input_ids.tolist() == [7, 8]


def test_a_prompt_id_beyond_int64_is_refused_before_it_takes_blocks():
    sched = Scheduler(num_blocks=16, block_size=4, group_windows={"full": None})
    with pytest.raises(ValueError, match=r"^a prompt is a sequence of token ids \(ints >= 0 that fit int64\)"):
        sched.add_request(np.array([2**63], dtype=np.uint64), max_new_tokens=2)
    ok = sched.add_request(np.array([2**63 - 1, 5], dtype=np.uint64), max_new_tokens=1)
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == [ok] and step.input_ids.tolist() == [2**63 - 1, 5]
    assert sched.blocks_in_use() == {"full": 1}


def test_a_prompt_id_past_the_vocabulary_is_refused_before_anything_is_queued():
    sched = Scheduler(num_blocks=16, block_size=4, group_windows={"full": None}, vocab_size=10)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: token id 10 is past the model's vocabulary of 10 \(its "
                                         r"input embeddings\): tokenize with the model's own tokenizer$"):
        sched.add_requests([[1, 2], [3, 10]], max_new_tokens=2)
    assert not sched.has_unfinished()
    sched.add_request([9, 0], max_new_tokens=1)
    assert sched.schedule().input_ids.tolist() == [9, 0]
    with pytest.raises(ValueError, match="^vocab_size must be an int"):
        Scheduler(num_blocks=16, block_size=4, group_windows={"full": None}, vocab_size=10.0)


def test_a_full_allocator_raises_and_hands_out_nothing():
    allocator = BlockAllocator(3, block_size=4)
    table = []
    allocator.grow(table, 4)
    held, free = list(table), list(allocator.free)
    with pytest.raises(RuntimeError, match="KV cache full: need 3 more blocks, 2 free"):
        allocator.grow(table, 16)
    assert table == held and allocator.free == free


@pytest.mark.parametrize("seed", range(4))
def test_steps_match_each_requests_own_state_under_random_traffic(seed):
    """Random traffic (arrivals while others decode, chunked prompts, EOS and length finishes, a
    full and a rolling window group, few seats so that they are reused): every step's lengths,
    ids, positions, tables and sample rows equal what each request's own tokens and tables say,
    rebuilt request by request; no block is held twice, and all are free at the end."""
    rng = np.random.default_rng(seed)
    bs, window = 4, 7
    sched = Scheduler(num_blocks={"full": 128, "swa": 40}, block_size=bs, group_windows={"full": None, "swa": window},
                      max_num_seqs=3, max_num_batched_tokens=int(rng.integers(4, 16)))

    def arrive():
        prompt = rng.integers(1, 40, int(rng.integers(1, 30))).tolist()
        sched.add_request(prompt, max_new_tokens=int(rng.integers(1, 24)), eos_token_id=0)

    for _ in range(3):
        arrive()
    late = 12
    while sched.has_unfinished():
        if late and rng.random() < 0.3:
            arrive()
            late -= 1
        step = sched.schedule()
        starts = [r.num_computed for r in step.requests]
        query_lens = step.query_lens.tolist()
        assert step.seq_lens.tolist() == [s + q for s, q in zip(starts, query_lens, strict=True)]
        assert step.input_ids.tolist() == [t for r, s, q in zip(step.requests, starts, query_lens, strict=True)
                                           for t in r.tokens[s:s + q]]
        assert step.positions.tolist() == [p for s, q in zip(starts, query_lens, strict=True) for p in range(s, s + q)]
        ends = np.cumsum(query_lens) - 1
        last = [i for i, r in enumerate(step.requests) if starts[i] + query_lens[i] == len(r.tokens)]
        assert step.sample_rows == ends[last].tolist() and step.sampled == [step.requests[i] for i in last]
        width = -(-int(step.seq_lens.max()) // bs)
        for g in ("full", "swa"):
            expected = np.zeros((len(step.requests), width), dtype=np.int32)
            for i, r in enumerate(step.requests):
                expected[i, :len(r.tables[g])] = r.tables[g]
                assert len(r.tables[g]) >= -(-int(step.seq_lens[i]) // bs)
            np.testing.assert_array_equal(step.block_tables[g], expected)
            held = [b for r in sched.running for b in r.tables[g] if b != ROLLED]
            assert len(held) == len(set(held)) == sched.blocks_in_use()[g] and NULL_BLOCK not in held
        for r, s in zip(step.requests, starts, strict=True):  # the window group keeps the window's blocks only
            first = max(s - window + 1, 0) // bs
            assert all(b == ROLLED for b in r.tables["swa"][:first]) and ROLLED not in r.tables["swa"][first:]
        sched.update(step, rng.integers(0, 40, len(step.sample_rows)).tolist())
    assert sched.blocks_in_use() == {"full": 0, "swa": 0}

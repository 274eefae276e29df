"""Several layer groups in one forward (docs/design.md, section 4b): one metadata per group in the
forward context, each backend planning per group, the graph State of several groups, and rolling
block tables for sliding-window groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_xformers import host_metadata

import compiled_attn as ca
from compiled_attn.backends.flashinfer import FlashInferBackend
from compiled_attn.backends.xformers import XFormersBackend
from compiled_attn.graphs import CUDAGraphRunner
from compiled_attn.groups import GroupedMetadata, GroupedState

SDPA = ca.get_attn_backend("TORCH_SDPA")


def spec_of(backend_dtype=torch.float32, **kw) -> ca.AttentionSpec:
    base = dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, num_blocks=32, dtype=backend_dtype,
                device="cpu")
    return ca.AttentionSpec(**{**base, **kw})


FULL, WINDOW = spec_of(), spec_of(sliding_window=5, scale=0.3)
SEQ_LENS, QUERY_LENS = [20, 40, 17], [20, 3, 1]
TABLES = {"full": [[1, 2], [3, 4, 5], [6, 7]], "window": [[8, 9], [10, 11, 12], [13, 14]]}


def random_step(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = sum(QUERY_LENS)
    q = torch.randn(n, 4 * 64, generator=g)
    k, v = torch.randn(n, 2 * 64, generator=g), torch.randn(n, 2 * 64, generator=g)
    caches = {name: torch.randn(SDPA.get_kv_cache_shape(32, 16, 2, 64), generator=g) for name in TABLES}
    return q, k, v, caches


def test_each_layer_reads_its_groups_metadata():
    specs = {"full": FULL, "window": WINDOW}
    mds = {name: SDPA.get_builder_cls()(spec).build(SEQ_LENS, QUERY_LENS, TABLES[name]) for name, spec in specs.items()}
    layers = {name: ca.Attention(4, 64, spec.softmax_scale, num_kv_heads=2, sliding_window=spec.sliding_window,
                                 backend="TORCH_SDPA", group=name) for name, spec in specs.items()}
    q, k, v, caches = random_step()
    grouped_caches = {name: c.clone() for name, c in caches.items()}
    with ca.set_forward_context(mds):  # a dict becomes GroupedMetadata
        assert isinstance(ca.get_forward_context().attn_metadata, GroupedMetadata)
        grouped = {name: layer(q, k, v, grouped_caches[name]) for name, layer in layers.items()}
    for name, layer in layers.items():  # each alone, on its own metadata: the single-group call
        with ca.set_forward_context(mds[name]):
            alone = layer(q, k, v, caches[name])
        torch.testing.assert_close(grouped[name], alone, rtol=0, atol=0)
        assert torch.equal(grouped_caches[name], caches[name])
    assert not torch.allclose(grouped["full"], grouped["window"])


def test_a_grouped_context_refuses_layers_outside_its_groups():
    md = SDPA.get_builder_cls()(FULL).build(SEQ_LENS, QUERY_LENS, TABLES["full"])
    q, k, v, caches = random_step()
    for group, match in ((None, "has no group"), ("other", "group 'other'")):
        layer = ca.Attention(4, 64, 0.125, num_kv_heads=2, backend="TORCH_SDPA", group=group)
        with pytest.raises(ValueError, match=match), ca.set_forward_context({"full": md}):
            layer(q, k, v, caches["full"])
    with pytest.raises(ValueError, match="group must be a str"):
        ca.Attention(4, 64, 0.125, num_kv_heads=2, backend="TORCH_SDPA", group=3)


def test_grouped_metadata_refuses_groups_of_different_steps():
    a = SDPA.get_builder_cls()(FULL).build(SEQ_LENS, QUERY_LENS, TABLES["full"])
    b = SDPA.get_builder_cls()(WINDOW).build([20, 40], [20, 3], TABLES["window"][:2])
    with pytest.raises(ValueError, match="different steps"):
        GroupedMetadata.of({"full": a, "window": b})
    with pytest.raises(ValueError, match="non-empty"):
        GroupedMetadata.of({})


def test_grouped_metadata_refuses_groups_of_different_backends(fake_flashinfer):
    spec = spec_of(torch.bfloat16)
    mds = {"sdpa": SDPA.get_builder_cls()(spec).build(SEQ_LENS, QUERY_LENS, TABLES["full"]),
           "flashinfer": FlashInferBackend.get_builder_cls()(spec).build(SEQ_LENS, QUERY_LENS, TABLES["window"])}
    match = "^groups 'sdpa' and 'flashinfer' come from different backends: one forward runs one backend$"
    with pytest.raises(ValueError, match=match):
        GroupedMetadata.of(mds)
    with pytest.raises(ValueError, match=match), ca.set_forward_context(mds):
        pass


@pytest.mark.parametrize("states", [
    lambda: {},
    lambda: [SDPA.get_state_cls()(FULL)],  # the States without their group names
    lambda: {"full": FULL},  # a spec, not its State
], ids=["empty", "list", "spec"])
def test_grouped_state_refuses_what_is_not_a_mapping_of_states(states):
    with pytest.raises(ValueError, match=r"^GroupedState needs a non-empty \{group name: AttentionState\} mapping$"):
        GroupedState(states())


def test_flashinfer_plans_every_group_with_its_own_window_cap_and_scale(fake_flashinfer):
    specs = {"full": spec_of(torch.bfloat16), "local": spec_of(torch.bfloat16, sliding_window=8, logits_soft_cap=30.0,
                                                               scale=0.25)}
    md = GroupedMetadata.of({name: FlashInferBackend.get_builder_cls()(spec).build(SEQ_LENS, QUERY_LENS, TABLES[t])
                             for (name, spec), t in zip(specs.items(), TABLES, strict=True)})
    planned = {}
    for name in specs:
        plan = md.for_group(name).step_plan
        plan.ensure_planned(md.for_group(name))
        planned[name] = {k: plan.wrapper(k).plans[0][1] for k in ("prefill", "decode")}
    for kind in ("prefill", "decode"):
        full, local = planned["full"][kind], planned["local"][kind]
        assert (full["window_left"], full["logits_soft_cap"], full["sm_scale"]) == (-1, None, 64**-0.5)
        assert (local["window_left"], local["logits_soft_cap"], local["sm_scale"]) == (7, 30.0, 0.25)


def test_flashinfer_rolling_page_list_starts_at_the_window(fake_flashinfer):
    spec = spec_of(torch.bfloat16, sliding_window=20, block_size=4)
    builder = FlashInferBackend.get_builder_cls()(spec, rolling_tables=True)
    # request 0: 6-token chunk at 30..35 (window of position 30 starts at 11: blocks 0-1 rolled);
    # request 1 decodes at position 8 (nothing rolled)
    table = np.array([[-1, -1, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 0, 0, 0, 0, 0, 0]], dtype=np.int32)
    md = builder.build([36, 9], [6, 1], table)
    assert md.rolled_blocks.tolist() == [2, 0]
    assert md.paged_kv_indptr.tolist() == [0, 7, 10]
    assert md.paged_kv_indices.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert md.paged_kv_last_page_len.tolist() == [4, 1]
    # the rolled entries are not checked: the same table without rolling names block -1
    with pytest.raises(ValueError, match="names block -1"):
        FlashInferBackend.get_builder_cls()(spec).build([36, 9], [6, 1], table)


def test_xformers_groups_build_their_own_window_starts():
    specs = {"full": spec_of(torch.bfloat16, block_size=64), "local": spec_of(torch.bfloat16, block_size=64,
                                                                               sliding_window=8)}
    tables = [[1], [2], [3]]
    starts = {name: host_metadata(spec, SEQ_LENS, QUERY_LENS, tables).decode_window_starts
              for name, spec in specs.items()}
    assert starts["full"] is None and starts["local"].tolist() == [17 - 8, 0]
    assert XFormersBackend.get_builder_cls()(specs["local"], rolling_tables=True).rolling_tables


def grouped_model(specs: dict[str, ca.AttentionSpec], seed: int):
    """(model, caches): one TORCH_SDPA layer per group of `specs` over one embedding and projection,
    random weights and caches from `seed`, the layers' outputs summed."""
    layers = {name: ca.Attention(4, 64, 0.125, num_kv_heads=2, sliding_window=s.sliding_window,
                                 backend="TORCH_SDPA", group=name) for name, s in specs.items()}
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(64, 4 * 64, generator=g) * 0.1
    wkv = torch.randn(64, 2 * 64, generator=g) * 0.1
    table = torch.randn(16, 64, generator=g)  # random rows: a step that mixed up its token ids would differ

    def model(input_ids, positions, kv_caches):
        x = torch.nn.functional.embedding(input_ids, table) * (1 + positions[:, None] / 32)
        q, kv = x @ wq, x @ wkv
        return sum(layer(q, kv, kv, cache) for layer, cache in zip(layers.values(), kv_caches, strict=True))

    caches = [torch.randn(SDPA.get_kv_cache_shape(32, 16, 2, 64), generator=g) for _ in specs]
    return model, caches


def clone_for_two(states: dict) -> tuple[GroupedState, dict[str, torch.Tensor]]:
    """A GroupedState of `states` made ready for batch 2 (static buffers, its metadata), and the
    clone that graph's refills go through with those buffers."""
    grouped = GroupedState(states)
    with grouped.graph_capture(2):
        bufs = grouped.get_graph_input_buffers(grouped.graph_capture_get_metadata_for_batch(2))
        return grouped.graph_clone(2), bufs


@pytest.mark.parametrize("names", [("full", "layers/sliding"), ("a", "a/b")])
def test_grouped_state_routes_buffers_of_groups_whose_names_hold_a_slash(names):
    """Group names are any str: the flat buffer keys ("group/field") split at the last "/", so a
    name holding one (or another group's name and a "/") still gets its own buffers."""
    spec = spec_of(max_seq_len_to_capture=64)
    clone, bufs = clone_for_two({g: SDPA.get_state_cls()(spec) for g in names})
    tables = {names[0]: [[1, 0], [2, 3]], names[1]: [[4, 0], [5, 6]]}  # one step, each group its blocks
    md = GroupedMetadata.of({g: SDPA.get_builder_cls()(spec).build([12, 31], [1, 1], [row[: 1 + i] for i, row
                                                                                     in enumerate(tables[g])])
                             for g in names})
    clone.prepare_graph_input_buffers(bufs, md)
    assert {g: bufs[f"{g}/block_tables"][:, :2].tolist() for g in names} == tables


@pytest.mark.parametrize("whose", ["other-groups", "a-group-missing"])
def test_grouped_state_refuses_buffers_not_its_own(whose):
    spec = spec_of(max_seq_len_to_capture=64)
    clone, bufs = clone_for_two({g: SDPA.get_state_cls()(spec) for g in ("a", "b")})
    if whose == "other-groups":
        other = clone_for_two({g: SDPA.get_state_cls()(spec) for g in ("x", "y")})[1]
    else:
        other = {k: t for k, t in bufs.items() if k[0] == "a"}
    md = GroupedMetadata.of({g: SDPA.get_builder_cls()(spec).build([5], [1], [[3]]) for g in ("a", "b")})
    before = {k: t.clone() for k, t in bufs.items()}
    with pytest.raises(RuntimeError, match=r"^these buffers are not this state's \(groups \["):
        clone.prepare_graph_input_buffers(other, md)
    assert all(torch.equal(bufs[k], before[k]) for k in before)


def test_grouped_state_serves_a_runner_whose_groups_differ():
    """Two groups of one model through CUDAGraphRunner's padded static-buffer step (CPU: no capture):
    decode outputs equal the eager step's."""
    specs = {"full": spec_of(max_seq_len_to_capture=64), "window": spec_of(sliding_window=5, max_seq_len_to_capture=64)}
    model, caches = grouped_model(specs, seed=0)
    state = GroupedState({name: SDPA.get_state_cls()(s) for name, s in specs.items()})
    runner = CUDAGraphRunner(model, SDPA, specs["full"], caches, state, capture_sizes=[1, 4], use_cuda_graphs=False,
                             progress=False)
    runner.capture()
    builders = {name: SDPA.get_builder_cls()(s) for name, s in specs.items()}
    seq_lens, tables = [9, 30, 17], {"full": [[1], [2, 3], [4, 5]], "window": [[6], [7, 8], [9, 10]]}
    md = GroupedMetadata.of({name: b.build(seq_lens, [1, 1, 1], tables[name]) for name, b in builders.items()})
    ids, pos = torch.tensor([3, 5, 7]), torch.tensor([8, 29, 16])
    eager_caches = [c.clone() for c in caches]
    graphed = runner.run(md, ids, pos)
    # the graph step read the groups' host arrays only: no group uploaded its device fields
    assert not any(group.is_uploaded("slot_mapping") for group in md.groups.values())
    assert md.slot_mapping.tolist() == [1 * 16 + 8, 3 * 16 + 13, 5 * 16 + 0]  # the first group's, read now
    with ca.set_forward_context(md):
        eager = model(ids, pos, eager_caches)
    assert runner.counts["graph"] == 1
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)  # padded batch: another summation order
    bufs = runner._captured[4, runner.widths[0]].input_buffers
    assert {k.partition("/")[0] for k in bufs} == {"full", "window"}
    # a captured upload (what the runner's CUDA graphs do): prepare writes the host side only
    before = {k: t.clone() for k, t in bufs.items()}
    clone = runner._captured[4, runner.widths[0]].graph_state
    md = GroupedMetadata.of({name: b.build([12, 31], [1, 1], tables[name][:2]) for name, b in builders.items()})
    clone.prepare_graph_input_buffers(bufs, md, upload=False)
    assert all(torch.equal(bufs[k], before[k]) for k in bufs)
    assert clone.upload_graph_input_buffers(bufs) is True
    assert bufs["full/seq_lens_tensor"].tolist() == bufs["window/seq_lens_tensor"].tolist() == [12, 31, 1, 1]
    with pytest.raises(ValueError, match="different table widths"):
        GroupedState({"a": SDPA.get_state_cls()(specs["full"]), "b": SDPA.get_state_cls()(spec_of())})


GROUP_SPECS = {"full": spec_of(max_seq_len_to_capture=64),
               "window": spec_of(sliding_window=5, max_seq_len_to_capture=64)}


def refused_with_every_buffer_as_it_was(md, match: str):
    """A grouped runner (batch 2) given `md`: `match`'s ValueError, raised before any static buffer
    (the groups' inputs, the token ids and positions) was written. Returns the captured entry."""
    model, caches = grouped_model(GROUP_SPECS, seed=0)
    state = GroupedState({name: SDPA.get_state_cls()(s) for name, s in GROUP_SPECS.items()})
    runner = CUDAGraphRunner(model, SDPA, GROUP_SPECS["full"], caches, state, capture_sizes=[2], use_cuda_graphs=False,
                             progress=False)
    runner.capture()
    entry = runner._captured[2, runner.widths[0]]
    before = {k: t.clone() for k, t in entry.input_buffers.items()}
    ids_before, pos_before = runner._input_ids.clone(), runner._positions.clone()
    with pytest.raises(ValueError, match=match):
        runner.run(md, torch.tensor([3, 5]), torch.tensor([8, 29]))
    assert all(torch.equal(entry.input_buffers[k], before[k]) for k in before)
    assert torch.equal(runner._input_ids, ids_before) and torch.equal(runner._positions, pos_before)
    return entry


def test_a_grouped_runner_refuses_one_groups_metadata_and_writes_nothing():
    """A graph step given one group's metadata instead of the GroupedMetadata of every group is
    refused before any static buffer is written."""
    md = SDPA.get_builder_cls()(GROUP_SPECS["full"]).build([9, 30], [1, 1], [[1], [2, 3]])
    match = rf"^a GroupedState serves GroupedMetadata \(one metadata per group\), got {type(md).__name__}$"
    entry = refused_with_every_buffer_as_it_was(md, match)
    with pytest.raises(ValueError, match=match):
        entry.graph_state.begin_forward(md)


def test_a_grouped_runner_step_the_second_group_refuses_writes_no_groups_buffers():
    """Every group's step is checked before any group's buffers are written: metadata whose
    second group was built for another cache size is refused with the first group's buffers, the
    ids and the positions as they were."""
    other = spec_of(sliding_window=5, max_seq_len_to_capture=64, num_blocks=40)
    md = GroupedMetadata.of({"full": SDPA.get_builder_cls()(GROUP_SPECS["full"]).build([9, 30], [1, 1], [[1], [2, 3]]),
                             "window": SDPA.get_builder_cls()(other).build([9, 30], [1, 1], [[4], [5, 6]])})
    refused_with_every_buffer_as_it_was(md, r"^metadata for num_blocks=40, block_size=16 does not match the "
                                            r"state's spec \(32, 16\)")


class FullWidthOnlyState(SDPA.get_state_cls()):
    """Declares the full table width only, as TORCH_SDPA's State on FlexAttention (CUDA) does."""

    def graph_table_widths(self) -> tuple[int, ...]:
        return (max(super().graph_table_widths()),)


def test_grouped_state_captures_the_widths_its_groups_share():
    """A full-attention group on flex (the full width only) beside a window group on the gather
    (narrower widths too), as TORCH_SDPA makes them on CUDA: the graphs capture the widths both
    declare, with a warning once, and a runner over them serves a step like eager."""
    import warnings

    specs = {"full": spec_of(max_seq_len_to_capture=1024),
             "window": spec_of(sliding_window=5, max_seq_len_to_capture=1024)}
    assert len(SDPA.get_state_cls()(specs["window"]).graph_table_widths()) > 1
    with pytest.warns(UserWarning, match=r"the graphs capture the widths they share, \[64\]"):
        state = GroupedState({"full": FullWidthOnlyState(specs["full"]),
                              "window": SDPA.get_state_cls()(specs["window"])})
    assert state.graph_table_widths() == (64,)
    model, caches = grouped_model(specs, seed=1)
    runner = CUDAGraphRunner(model, SDPA, specs["full"], caches, state, capture_sizes=[2], use_cuda_graphs=False,
                             progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the clones of each size and width do not warn again
        runner.capture()
    assert runner.widths == [64]
    builders = {name: SDPA.get_builder_cls()(s) for name, s in specs.items()}
    tables = {"full": [[1], [2, 3]], "window": [[6], [7, 8]]}
    md = GroupedMetadata.of({name: b.build([9, 30], [1, 1], tables[name]) for name, b in builders.items()})
    ids, pos = torch.tensor([3, 5]), torch.tensor([8, 29])
    eager_caches = [c.clone() for c in caches]
    graphed = runner.run(md, ids, pos)
    with ca.set_forward_context(md):
        eager = model(ids, pos, eager_caches)
    assert runner.counts["graph"] == 1
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)


class PrepareUploadsState(SDPA.get_state_cls()):
    """A State that keeps the abstract default: its graphs' upload is not captured, its prepare uploads."""

    def upload_graph_input_buffers(self, input_buffers: dict[str, torch.Tensor]) -> bool:
        return ca.AttentionState.upload_graph_input_buffers(self, input_buffers)

    def prepare_graph_input_buffers(self, input_buffers: dict[str, torch.Tensor], attn_metadata) -> None:
        super().prepare_graph_input_buffers(input_buffers, attn_metadata)  # no `upload`: none may be passed


def test_grouped_state_captures_the_upload_only_when_every_group_does():
    """A group whose State does not capture its upload: the grouped State reports False, so the
    runner keeps calling prepare without `upload` (each group uploads there); the capturing
    group's upload still runs (queued twice, it writes the same bytes)."""
    spec = spec_of(max_seq_len_to_capture=64)
    clone, bufs = clone_for_two({"a": SDPA.get_state_cls()(spec), "b": PrepareUploadsState(spec)})
    mds = {g: SDPA.get_builder_cls()(spec).build([12, 31], [1, 1], [[1], [2, 3]]) for g in ("a", "b")}
    md = GroupedMetadata.of(mds)
    clone.states["a"].prepare_graph_input_buffers(clone._per_group(bufs)["a"], mds["a"], upload=False)  # its mirror
    assert bufs["a/seq_lens_tensor"].tolist() == [1, 1]
    assert clone.upload_graph_input_buffers(bufs) is False
    assert bufs["a/seq_lens_tensor"].tolist() == [12, 31], "the capturing group uploaded"
    assert bufs["b/seq_lens_tensor"].tolist() == [1, 1], "the other group uploads in its prepare"
    clone.prepare_graph_input_buffers(bufs, md)
    assert bufs["a/seq_lens_tensor"].tolist() == bufs["b/seq_lens_tensor"].tolist() == [12, 31]


def test_a_grouped_state_calls_the_prepare_a_groups_state_overrides():
    """The check-all-then-write path is only for States whose prepare is GraphState's own: one
    that overrides `prepare_graph_input_buffers` (the contract's hook) gets its call."""
    calls = []

    class Recording(SDPA.get_state_cls()):
        def prepare_graph_input_buffers(self, input_buffers, attn_metadata, *, upload=True):
            calls.append(attn_metadata)
            super().prepare_graph_input_buffers(input_buffers, attn_metadata, upload=upload)

    spec = spec_of(max_seq_len_to_capture=64)
    clone, bufs = clone_for_two({"a": SDPA.get_state_cls()(spec), "b": Recording(spec)})
    mds = {g: SDPA.get_builder_cls()(spec).build([12, 31], [1, 1], [[1], [2, 3]]) for g in ("a", "b")}
    clone.prepare_graph_input_buffers(bufs, GroupedMetadata.of(mds))
    assert calls == [mds["b"]] and bufs["a/seq_lens_tensor"].tolist() == bufs["b/seq_lens_tensor"].tolist() == [12, 31]


def test_grouped_runner_feeds_tokens_back_with_positions_from_the_first_group():
    """feed_back_tokens on grouped layers: the graph step's positions come from the first group's
    static lengths and its pad mask from the first group's slots; each step's tokens, fed back in
    place, equal the model's own with explicit positions."""
    specs = {"full": spec_of(max_seq_len_to_capture=64), "window": spec_of(sliding_window=5, max_seq_len_to_capture=64)}
    model, caches = grouped_model(specs, seed=1)
    eager_caches = [c.clone() for c in caches]
    state = GroupedState({name: SDPA.get_state_cls()(s) for name, s in specs.items()})

    def next_ids(out):  # valid ids of the model's 16-row embedding
        return out.argmax(-1) % 16

    runner = CUDAGraphRunner(model, SDPA, specs["full"], caches, state, capture_sizes=[4], use_cuda_graphs=False,
                             progress=False, postprocess=next_ids, feed_back_tokens=True)
    runner.capture()
    builders = {name: SDPA.get_builder_cls()(s) for name, s in specs.items()}
    seq_lens, tables = [9, 30, 17], {"full": [[1], [2, 3], [4, 5]], "window": [[6], [7, 8], [9, 10]]}
    tokens = torch.tensor([3, 5, 7])
    for _ in range(3):
        md = GroupedMetadata.of({name: b.build(seq_lens, [1, 1, 1], tables[name]) for name, b in builders.items()})
        with ca.set_forward_context(md):
            want = next_ids(model(tokens.clone(), torch.tensor(seq_lens) - 1, eager_caches))
        tokens = runner.run(md, tokens, copy_output=False)
        assert torch.equal(tokens, want) and tokens.data_ptr() == runner._input_ids.data_ptr()
        assert runner._input_ids[3] == 0  # the pad row
        seq_lens = [s + 1 for s in seq_lens]
    assert runner.counts["graph"] == 3
    for got, want in zip(caches, eager_caches, strict=True):  # K/V written at the derived positions' slots
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

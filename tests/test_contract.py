"""The pinned public contract (docs/design.md): the names and signatures tests outside this repo call."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import compiled_attn as ca
from compiled_attn.graphs import DEFAULT_CAPTURE_SIZES, CUDAGraphRunner
from compiled_attn.registry import BACKEND_CLASSES


def params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def test_attention_types():
    assert {t.name for t in ca.AttentionType} == {"DECODER", "ENCODER", "ENCODER_ONLY", "ENCODER_DECODER"}


def test_spec_fields_and_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(ca.AttentionSpec)}
    assert list(fields) == ["num_heads", "num_kv_heads", "head_size", "block_size", "num_blocks", "dtype", "device",
                            "kv_cache_dtype", "scale", "sliding_window", "logits_soft_cap", "alibi_slopes",
                            "attn_type", "max_seq_len_to_capture"]
    assert fields["kv_cache_dtype"] == "auto" and fields["max_seq_len_to_capture"] == 8192
    with pytest.raises(TypeError):
        ca.AttentionSpec(8, 2, 64, 16, 32)  # keyword-only


def test_kv_cache_torch_dtype():
    assert ca.kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert ca.kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert ca.kv_cache_torch_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2


def test_backend_factory(contract_backend):
    backend = contract_backend
    assert BACKEND_CLASSES()[backend.get_name()] is backend
    for getter, base in (("get_impl_cls", ca.AttentionImpl), ("get_metadata_cls", ca.AttentionMetadata),
                         ("get_builder_cls", ca.AttentionMetadataBuilder), ("get_state_cls", ca.AttentionState)):
        assert issubclass(getattr(backend, getter)(), base)
    assert params(backend.get_kv_cache_shape) == ["num_blocks", "block_size", "num_kv_heads", "head_size"]
    assert params(backend.swap_blocks) == ["src_kv_cache", "dst_kv_cache", "src_to_dst"]
    assert params(backend.copy_blocks) == ["kv_caches", "src_to_dists"]
    assert params(backend.get_builder_cls().build) == ["seq_lens", "query_lens", "block_tables", "encoder_seq_lens",
                                                       "cross_block_tables"]
    impl = backend.get_impl_cls()
    assert params(impl.__init__) == ["num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes",
                                     "sliding_window", "kv_cache_dtype", "logits_soft_cap"]
    assert params(impl.forward) == ["query", "key", "value", "kv_cache", "attn_metadata", "k_scale", "v_scale",
                                    "attn_type"]
    state = backend.get_state_cls()
    for method, args in (("graph_capture", ["max_batch_size"]), ("graph_capture_get_metadata_for_batch",
                         ["batch_size", "table_width"]), ("graph_clone", ["batch_size", "table_width"]),
                         ("get_graph_input_buffers", ["attn_metadata"]),
                         ("prepare_graph_input_buffers", ["input_buffers", "attn_metadata", "upload"]),
                         ("upload_graph_input_buffers", ["input_buffers"]),
                         ("begin_forward", ["attn_metadata"]), ("graph_table_widths", [])):
        assert params(getattr(state, method)) == args, method
    # the extensions: keyword-only, optional
    for method, name, default in (("graph_capture_get_metadata_for_batch", "table_width", None),
                                  ("graph_clone", "table_width", None),
                                  ("prepare_graph_input_buffers", "upload", True)):
        kw = inspect.signature(getattr(state, method)).parameters[name]
        assert (kw.kind, kw.default) == (inspect.Parameter.KEYWORD_ONLY, default), method


def test_get_attn_backend_and_layer_signatures():
    assert params(ca.get_attn_backend) == ["name", "spec"]
    assert params(ca.Attention.__init__) == ["num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes",
                                             "sliding_window", "kv_cache_dtype", "logits_soft_cap", "attn_type",
                                             "backend", "k_scale", "v_scale", "group"]  # group: extension
    assert params(ca.Attention.forward) == ["query", "key", "value", "kv_cache"]


def test_metadata_fields():
    spec = ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, block_size=4, num_blocks=8,
                            dtype=torch.float32, device="cpu")
    md = ca.get_attn_backend("TORCH_SDPA").get_builder_cls()(spec).build([5, 3], [5, 1], [[0, 1], [2]])
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (1, 5, 1)
    assert md.slot_mapping.dtype == torch.int64
    assert md.prefill_metadata.num_prefills == 1 and md.decode_metadata.num_decode_tokens == 1
    assert md.asdict_zerocopy()["slot_mapping"] is md.slot_mapping


def test_graph_runner_defaults():
    assert list(DEFAULT_CAPTURE_SIZES) == [1, 2, 4] + list(range(8, 257, 8))
    assert params(CUDAGraphRunner.run)[:3] == ["attn_metadata", "input_ids", "positions"]


def test_public_names():
    pinned = {"Attention", "AttentionBackend", "AttentionImpl", "AttentionMetadata", "AttentionMetadataBuilder",
              "AttentionSpec", "AttentionState", "AttentionType", "BackendUnavailableError", "get_attn_backend",
              "get_forward_context", "kv_cache_torch_dtype", "set_forward_context"}
    assert pinned | {"mark_token_dim"} <= set(ca.__all__)
    assert all(hasattr(ca, name) for name in ca.__all__)

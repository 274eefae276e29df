"""Backend selection: auto, by environment, by name; errors say why a backend cannot serve."""

from __future__ import annotations

import re

import pytest
import torch
import toy_backend

import compiled_attn as ca
from compiled_attn.capabilities import smallest_block_size
from compiled_attn.registry import BACKEND_CLASSES, ENV_VAR, register_backend

CUDA_ONLY = ["FLASHINFER", "XFORMERS"]


def spec(**kw) -> ca.AttentionSpec:
    args = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, num_blocks=8, dtype=torch.float32,
                device="cpu")
    return ca.AttentionSpec(**(args | kw))


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_auto_picks_torch_sdpa_on_cpu():
    assert ca.get_attn_backend().get_name() == "TORCH_SDPA"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA a faster backend may be chosen")
def test_auto_with_cuda_spec_on_cpu_machine_still_picks_torch_sdpa():
    assert ca.get_attn_backend(spec=spec(device="cuda", dtype=torch.bfloat16)).get_name() == "TORCH_SDPA"


def test_auto_with_cpu_spec_picks_torch_sdpa():
    assert ca.get_attn_backend(spec=spec()).get_name() == "TORCH_SDPA"


def test_layer_without_backend_picks_one_that_supports_the_layer(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    cuda = torch.cuda.is_available()
    spec = ca.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, block_size=64, num_blocks=1,
                            dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu")
    assert ca.Attention(8, 64, 0.125, 2).backend is ca.get_attn_backend(None, spec)
    # soft-cap with cross attention: only TORCH_SDPA has both, wherever this runs
    layer = ca.Attention(8, 64, 0.125, 2, logits_soft_cap=5.0, attn_type=ca.AttentionType.ENCODER_DECODER)
    assert layer.backend.get_name() == "TORCH_SDPA"


@pytest.mark.parametrize("value", ["TORCH_SDPA", "torch_sdpa"])
def test_env_var_is_honoured(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    assert ca.get_attn_backend().get_name() == "TORCH_SDPA"


def test_name_overrides_env_var(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "NOPE")
    assert ca.get_attn_backend("TORCH_SDPA").get_name() == "TORCH_SDPA"


def test_env_var_unknown_name(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "NOPE")
    with pytest.raises(ValueError, match=r"unknown attention backend 'NOPE' \(from \$COMPILED_ATTN_BACKEND\); choose"):
        ca.get_attn_backend()


def test_named_backend_that_cannot_serve_spec_names_who_can_or_that_none_can():
    fp8 = {"kv_cache_dtype": "fp8", "dtype": torch.bfloat16, "device": "cuda"}  # FlashInfer's, spec-wise
    with pytest.raises(NotImplementedError, match="; FLASHINFER supports this spec$"):
        ca.get_attn_backend("TORCH_SDPA", spec(**fp8))
    with pytest.raises(NotImplementedError, match="; no registered backend does$"):  # FLASHINFER: no head size 16
        ca.get_attn_backend("TORCH_SDPA", spec(**fp8, head_size=16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machines")
def test_env_var_cuda_backend_on_cpu(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "FLASHINFER")
    with pytest.raises(ca.BackendUnavailableError, match="FLASHINFER"):
        ca.get_attn_backend()


@pytest.mark.parametrize("name", ["", 0, False, []], ids=repr)
def test_a_falsy_name_is_unknown_not_auto(name, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "TORCH_SDPA")  # what a falsy name read as None would have picked
    with pytest.raises(ValueError, match=f"unknown attention backend {re.escape(repr(name))}"):
        ca.get_attn_backend(name)


def test_named_unknown():
    with pytest.raises(ValueError, match="unknown attention backend 'FLASH'"):
        ca.get_attn_backend("FLASH")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machines")
@pytest.mark.parametrize("name", CUDA_ONLY)
def test_named_cuda_backend_on_cpu_says_why(name):
    # It cannot run here (its package, CUDA), said with the reason.
    with pytest.raises(ca.BackendUnavailableError, match=rf"{name} cannot run here: .+"):
        ca.get_attn_backend(name)
    assert issubclass(ca.BackendUnavailableError, RuntimeError)


def test_named_backend_that_cannot_serve_spec():
    message = r"TORCH_SDPA does not support kv_cache_dtype='fp8' \(only \('auto',\)\)"
    with pytest.raises(NotImplementedError, match=message):
        ca.get_attn_backend("TORCH_SDPA", spec(kv_cache_dtype="fp8"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only machines")
def test_auto_when_no_backend_can_serve_spec_lists_reasons():
    with pytest.raises(NotImplementedError, match="no attention backend can serve this: .*TORCH_SDPA: .*fp8"):
        ca.get_attn_backend(spec=spec(kv_cache_dtype="fp8"))


@pytest.mark.parametrize(("options", "attn_type", "hint"), [
    (dict(logits_soft_cap=30.0), ca.AttentionType.ENCODER, "use TORCH_SDPA"),  # XFORMERS has no soft-cap
    (dict(kv_cache_dtype="fp8"), ca.AttentionType.ENCODER_DECODER, "no registered backend has all of them"),
], ids=["soft-cap", "fp8"])
def test_a_refused_attention_type_names_backends_that_serve_the_layers_options_too(options, attn_type, hint):
    impl = BACKEND_CLASSES()["FLASHINFER"].get_impl_cls()(8, 64, 0.125, 2, **options)
    with pytest.raises(NotImplementedError, match=f"^FLASHINFER does not support {attn_type.name} attention; {hint}$"):
        impl.register(1.0, 1.0, attn_type)


def test_torch_sdpa_capabilities():
    backend = ca.get_attn_backend("TORCH_SDPA")
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert backend.get_impl_cls().__name__ == "TorchSDPAImpl"
    assert backend.get_builder_cls().__name__ == "TorchSDPAMetadataBuilder"
    assert backend.get_metadata_cls().__name__ == "TorchSDPAMetadata"
    assert issubclass(backend.get_state_cls(), ca.AttentionState)
    assert backend.unavailable_reason() is None
    for attn_type in ca.AttentionType:
        assert backend.unsupported_reason(spec(attn_type=attn_type)) is None


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype", "expected"),
    [
        ("auto", torch.bfloat16, torch.bfloat16),
        ("auto", torch.float32, torch.float32),
        ("fp8", torch.bfloat16, torch.float8_e4m3fn),
        ("fp8_e4m3", torch.float16, torch.float8_e4m3fn),
        ("fp8_e5m2", torch.bfloat16, torch.float8_e5m2),
    ],
)
def test_kv_cache_torch_dtype(kv_cache_dtype, dtype, expected):
    assert ca.kv_cache_torch_dtype(kv_cache_dtype, dtype) == expected


def test_kv_cache_torch_dtype_unknown():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4' is not one of"):
        ca.kv_cache_torch_dtype("fp4", torch.bfloat16)


def test_registered_backend_is_found_by_name_until_unregistered():
    with toy_backend.registered() as toy:
        assert list(BACKEND_CLASSES())[-1] == toy_backend.NAME  # last in auto-selection order
        assert ca.get_attn_backend(toy_backend.NAME.lower()) is toy
        assert ca.get_attn_backend(spec=spec()).get_name() == "TORCH_SDPA"  # auto-selection still prefers SDPA
        assert ca.Attention(8, 64, 0.125, 2, backend=toy_backend.NAME).backend is toy
    with pytest.raises(ValueError, match=f"unknown attention backend '{toy_backend.NAME}'"):
        ca.get_attn_backend(toy_backend.NAME)


def test_registering_a_taken_name_or_a_non_backend_raises():
    impostor = type("Impostor", (toy_backend.ToyDenseBackend,), {"get_name": staticmethod(lambda: "TORCH_SDPA")})
    with pytest.raises(ValueError, match="a backend named TORCH_SDPA is registered already"):
        register_backend(impostor)
    with pytest.raises(ValueError, match="takes an AttentionBackend subclass"):
        register_backend(object)
    # get_attn_backend looks names up in upper case: a lower-case name could never be selected
    mixed = type("Mixed", (toy_backend.ToyDenseBackend,), {"get_name": staticmethod(lambda: "MyToy")})
    with pytest.raises(ValueError, match=r"^backend names are upper-case \(get_attn_backend matches any case\), "
                                         r"got 'MyToy'$"):
        register_backend(mixed)
    assert "MyToy" not in BACKEND_CLASSES() and BACKEND_CLASSES()["TORCH_SDPA"].__name__ == "TorchSDPABackend"


@pytest.mark.parametrize(("name", "at_least", "want"),
                         [("XFORMERS", 16, 64), ("XFORMERS", 64, 64), ("TORCH_SDPA", 8, 8),
                          ("XFORMERS", 40032, 80064)])  # past 2**16, which once capped the doubling
def test_smallest_block_size_doubles_to_the_first_the_backend_takes(name, at_least, want):
    assert smallest_block_size(BACKEND_CLASSES()[name], at_least) == want


@pytest.mark.parametrize(("at_least", "match"), [(0, "^at_least must be >= 1, got 0$"),  # XFORMERS takes 0 (0 % 64)
                                                 (-4, "^at_least must be >= 1, got -4$"),
                                                 (2.0, "^at_least must be an int, got 2.0$")])
def test_smallest_block_size_refuses_a_start_that_is_not_a_positive_int(at_least, match):
    with pytest.raises(ValueError, match=match):
        smallest_block_size(BACKEND_CLASSES()["XFORMERS"], at_least)

import sys
import types
from pathlib import Path

import pytest
import torch

from compiled_attn.backends import flashinfer as fib

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class RecordingWrapper:
    def __init__(self, kind, *args, **kwargs):
        self.kind, self.init_kwargs, self.plans = kind, kwargs, []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A stand-in FlashInfer whose wrappers record their plan() calls (CPU tests of the planning)."""
    fake = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=lambda *a, **k: RecordingWrapper("prefill", *a, **k),
        BatchPrefillWithRaggedKVCacheWrapper=lambda *a, **k: RecordingWrapper("ragged", *a, **k),
        BatchDecodeWithPagedKVCacheWrapper=lambda *a, **k: RecordingWrapper("decode", *a, **k),
    )
    monkeypatch.setattr(fib, "_flashinfer", lambda: fake)
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
    return fake

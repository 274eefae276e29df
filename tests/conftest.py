import os
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import toy_backend  # noqa: E402
from scheduling import spread_long_tests  # noqa: E402

from compiled_attn.backends import flashinfer as fib  # noqa: E402
from compiled_attn.registry import BACKEND_CLASSES  # noqa: E402

# The backends the contract tests run (`contract_backend`, and `cpu_backend` for those that run on
# CPU): every registered one, then the toy backend of toy_backend.py. A new registered backend is
# picked up here with no change.
CONTRACT_BACKENDS = {**BACKEND_CLASSES(), toy_backend.NAME: toy_backend.ToyDenseBackend}
CPU_BACKENDS = [name for name, cls in CONTRACT_BACKENDS.items() if not cls.requires_cuda]


@pytest.hookimpl(trylast=True)  # after `-m gpu` deselects: xdist splits what is left
def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        items[:] = spread_long_tests(items, workers, _long_seconds)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _long_seconds(item) -> float:
    """A GPU test's `long(seconds)` mark: about how long it runs on an H100 beside five others."""
    mark = item.get_closest_marker("long")
    return mark.args[0] if mark else 0.0


def pytest_generate_tests(metafunc):
    """A test that takes `contract_backend` runs for every name of CONTRACT_BACKENDS (unless it
    names its own with `parametrize(..., indirect=True)`); `cpu_backend`: CPU_BACKENDS."""
    own = set()
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        own |= {n.strip() for n in names.split(",")} if isinstance(names, str) else set(names)
    for fixture, names in (("contract_backend", list(CONTRACT_BACKENDS)), ("cpu_backend", CPU_BACKENDS)):
        if fixture in metafunc.fixturenames and fixture not in own:
            metafunc.parametrize(fixture, names, indirect=True)


def _backend(name: str):
    if name == toy_backend.NAME:
        with toy_backend.registered() as cls:
            yield cls
    else:
        yield BACKEND_CLASSES()[name]


@pytest.fixture
def contract_backend(request):
    """The backend class the parameter names; the toy backend is registered for this test only."""
    yield from _backend(request.param)


@pytest.fixture
def cpu_backend(request):
    """As `contract_backend`, for the backends that run on CPU."""
    yield from _backend(request.param)


class RecordingWrapper:
    def __init__(self, kind, *args, **kwargs):
        self.kind, self.init_kwargs, self.plans = kind, kwargs, []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A stand-in FlashInfer whose wrappers record their plan() calls (CPU tests of the planning),
    mixed steps split (MIXED_STEP_ENV; a test of another choice sets it after this)."""
    monkeypatch.setenv(fib.MIXED_STEP_ENV, "split")
    fake = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=lambda *a, **k: RecordingWrapper("prefill", *a, **k),
        BatchPrefillWithRaggedKVCacheWrapper=lambda *a, **k: RecordingWrapper("ragged", *a, **k),
        BatchDecodeWithPagedKVCacheWrapper=lambda *a, **k: RecordingWrapper("decode", *a, **k),
    )
    monkeypatch.setattr(fib, "_flashinfer", lambda: fake)
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
    return fake

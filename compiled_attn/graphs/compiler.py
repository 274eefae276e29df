"""The Dynamo backend of `CUDAGraphRunner(compile=True)`: Inductor with COMPILE_OPTIONS, and batch 1's
graph compiled once per option set in ONE_TOKEN_COMPILES from its one trace, so that the runner can
capture a graph from each, time them and keep the faster (`CUDAGraphRunner._pick_one_token`).

One trace and one Dynamo cache entry serve both compiles: with a `torch.compile` wrapper per option
set, Dynamo traced the 32-layer model once more and kept one more entry on its forward code, which
counts toward `torch._dynamo.config.recompile_limit`.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._inductor.compile_fx import compile_fx

# With a static batch of one, Inductor lowers every linear layer to a reduction kernel instead of
# a cuBLAS GEMV, and only coordinate-descent tuning takes those kernels to full memory bandwidth
# (gpt-fast's setting; see torch/_inductor/decomposition.py, `mm`). Larger batches keep cuBLAS;
# the tuning also fits their fused kernels.
COMPILE_OPTIONS = {"coordinate_descent_tuning": True}
# Batch 1's compiles. The tuned reductions are a draw: on H200s the 8B loop took 4.6 to 6.0 ms a
# step with them, by process and machine, and 4.75-4.77 ms with cuBLAS's GEMVs; on an H100 the
# tuned ones won (5.86 against 6.35 ms; BENCHMARKS.md, twenty-eighth session). So with CUDA
# graphs, batch 1's graph is captured from both and the faster replay kept.
ONE_TOKEN_COMPILES = {"reductions": COMPILE_OPTIONS, "cublas": {"coordinate_descent_tuning": False}}
# The compile batch 1 runs without a pick (no CUDA graphs) and the one whose failure fails the
# compile; the others are candidates: one that fails to compile is dropped with a warning.
PRIMARY_ONE_TOKEN_COMPILE = "reductions"


class RunnerCompiler:
    """Inductor for every graph Dynamo hands over, with COMPILE_OPTIONS (read at each compile:
    patch the dict to try other options). A graph traced inside `one_token_calls()` (the runner's
    calls of one token) is batch 1's: until a compile is kept (`keep`), it is compiled once per
    ONE_TOKEN_COMPILES entry, and each call of it runs the compile `use` names; after, a batch-1
    graph traced again (another grad mode, other caches) is compiled with the kept options only.
    A candidate other than PRIMARY_ONE_TOKEN_COMPILE that fails to compile is left out with a
    warning, its error in `failed` (a pick then has one candidate fewer); the primary's failure
    raises, as any other compile's."""

    def __init__(self) -> None:
        self.use = PRIMARY_ONE_TOKEN_COMPILE
        self.kept: str | None = None
        self.failed: dict[str, str] = {}  # candidates that failed to compile: their errors
        self.compiles = 0  # graphs Dynamo handed over (none while Dynamo is disabled)
        self.one_token_graphs = 0  # of those, compiled per ONE_TOKEN_COMPILES entry
        # a context variable, as the forward context: per thread, and nested calls restore it
        self._one_token = contextvars.ContextVar(f"one_token_{id(self)}", default=False)

    @property
    def _tracing_one_token(self) -> bool:
        return self._one_token.get()

    @contextlib.contextmanager
    def one_token_calls(self) -> Iterator[None]:
        token = self._one_token.set(True)
        try:
            yield
        finally:
            self._one_token.reset(token)

    def keep(self, name: str) -> None:
        """Batch 1 runs `name`'s compile from now on, and a batch-1 graph traced again gets it alone."""
        self.use = self.kept = name

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.compiles += 1
        if not self._tracing_one_token:
            return compile_fx(gm, example_inputs, config_patches=COMPILE_OPTIONS)
        if self.kept is not None:
            return compile_fx(gm, example_inputs, config_patches=ONE_TOKEN_COMPILES[self.kept])
        # compile_fx may rewrite the graph it is given: every compile but the last gets a copy
        last = len(ONE_TOKEN_COMPILES) - 1
        compiled = {}
        for i, (name, options) in enumerate(ONE_TOKEN_COMPILES.items()):
            try:
                compiled[name] = compile_fx(gm if i == last else _copy_graph(gm), example_inputs,
                                            config_patches=options)
            except Exception as e:
                if name == PRIMARY_ONE_TOKEN_COMPILE:
                    raise
                self.failed[name] = f"{type(e).__name__}: {e}"
                warnings.warn(f"batch 1's {name!r} compile (options {options}) failed, so batch 1 goes without "
                              f"it: {self.failed[name]}", stacklevel=1)  # raised inside Dynamo: no caller to point at
        self.one_token_graphs += 1

        def run(*args: Any) -> Any:
            return compiled[self.use](*args)

        return run


def _copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of Dynamo's graph with the fields Dynamo sets beside it for AOTAutograd (each input's
    source, parameters' sources: which inputs are static), which `deepcopy` does not carry."""
    copied = copy.deepcopy(gm)
    copied._param_name_to_source = gm._param_name_to_source
    for node, copy_node in zip(gm.graph.find_nodes(op="placeholder"), copied.graph.find_nodes(op="placeholder"),
                               strict=True):
        copy_node._dynamo_source = node._dynamo_source
    return copied

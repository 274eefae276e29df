"""The transformers integration against transformers itself: greedy tokens equal
`model.generate(do_sample=False)` under its eager attention and per-step logits agree, for Llama,
Qwen2 (window on some layers), Mistral (window shorter than the prompts) and Gemma2 (alternating
windows, soft-cap, query_pre_attn_scalar); dropping a window, the cap or the scale must break the
agreement (negative controls). CPU: the fp32 model on TORCH_SDPA, plus FLASHINFER / XFORMERS with
float64 stand-in kernels, against transformers in float64; GPU (bf16): every backend that serves each
model, against transformers in float64."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from reference import record_compiles
from torch._dynamo.utils import counters

pytest.importorskip("transformers")

import compiled_attn as ca  # noqa: E402
from compiled_attn.backends import flashinfer as fib  # noqa: E402
from compiled_attn.backends.flashinfer import FlashInferBackend  # noqa: E402
from compiled_attn.backends.xformers import XFormersBackend  # noqa: E402
from compiled_attn.integrations import hf_random  # noqa: E402
from compiled_attn.integrations import transformers as ca_hf  # noqa: E402
from compiled_attn.ops import xformers as xformers_ops  # noqa: E402
from compiled_attn.paging import window_blocks  # noqa: E402

ca_hf.register()

# lengths 5..13 against windows of 6 tokens; a budget of 8 tokens chunks the long prompts and
# admits the later ones while the first decode
PROMPTS = [[5, 17, 9, 3, 44, 12, 7, 90, 31], [4, 4, 2, 60, 101, 9, 8],
           [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [77, 3, 5, 120, 6]]
NEW_TOKENS = 8
LOGITS_ATOL = 1e-5


def serve(engine: ca_hf.PagedEngine, prompts=PROMPTS, new_tokens=NEW_TOKENS, late: int = 1):
    """Serve `prompts` (the last `late` of them added after the first step) -> (tokens, logits) per prompt."""
    ids = [engine.add_request(p, new_tokens) for p in prompts[: len(prompts) - late]]
    engine.step()
    ids += [engine.add_request(p, new_tokens) for p in prompts[len(prompts) - late:]]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.output(i) for i in ids]
    return [o.output_tokens for o in outs], [torch.stack(o.logits) for o in outs]


def transformers_reference(ref: torch.nn.Module, prompts=PROMPTS, new_tokens=NEW_TOKENS):
    """transformers' own greedy generate (eager attention, one prompt at a time) and the logits of
    every step (teacher-forced over the generated sequence)."""
    tokens, logits = [], []
    for p in prompts:
        out = ref.generate(torch.tensor([p], device=ref.device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        tokens.append(out[0, len(p):].tolist())
        logits.append(ref(out).logits[0, len(p) - 1 : -1].cpu())
    return tokens, logits


def max_logit_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module", params=hf_random.FAMILIES)
def family(request):
    """(family, compiled_attn model, its eager twin, transformers' greedy tokens and logits)."""
    model = hf_random.random_model(hf_random.random_config(request.param), seed=1)
    ref = hf_random.eager_twin(model, torch.float64)
    return request.param, model, ref, transformers_reference(ref)


# ---------------------------------------------------------------------------------------------
# CPU: what the engine reads, and the fp32 model's agreement with transformers in float64


def test_register_makes_the_implementation_valid_and_it_runs_only_in_an_engine():
    model = hf_random.random_model(hf_random.random_config("llama"))
    assert model.config._attn_implementation == "compiled_attn"
    with pytest.raises(RuntimeError, match="PagedEngine"):
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="attn_implementation='compiled_attn'"):
        ca_hf.PagedEngine(hf_random.eager_twin(model), compile=False)
    # the runner's own refusal would name piecewise=True, which the engine does not take
    with pytest.raises(ValueError, match=r"capture_sizes=\[\] .* name batch sizes, or pass cuda_graphs=False"):
        ca_hf.PagedEngine(model, compile=False, capture_sizes=[])


EXPECTED_GROUPS = {  # family -> {group: (layers, window, soft-cap)}; tiny configs have 3 layers, window 6
    "llama": {"full": ([0, 1, 2], None, None)},
    "qwen2": {"full": ([0], None, None), "window6": ([1, 2], 6, None)},
    "mistral": {"window6": ([0, 1, 2], 6, None)},
    "gemma2": {"window6": ([0, 2], 6, 2.0), "full": ([1], None, 2.0)},
}


def test_engine_reads_every_layers_settings_from_the_model(family):
    name, model, _, _ = family
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=False, cuda_graphs=False)
    got = {g.name: (g.layers, g.spec.sliding_window, g.spec.logits_soft_cap) for g in engine.groups}
    assert got == EXPECTED_GROUPS[name]
    scale = (16 // 2) ** -0.5 if name == "gemma2" else 16**-0.5  # Gemma2: query_pre_attn_scalar = head_dim // 2
    assert all(g.spec.scale == pytest.approx(scale) for g in engine.groups)
    assert all(g.spec.num_heads == 4 and g.spec.num_kv_heads == 2 and g.spec.head_size == 16 for g in engine.groups)


def test_compiled_engine_matches_transformers_greedy_tokens_and_logits(family):
    """One compiled graph (fullgraph=True, no recompiles across prefills, chunks, admissions and
    decodes of 1..4 requests), served through the runner's padded static step."""
    _, model, _, (ref_tokens, ref_logits) = family
    torch._dynamo.reset()
    counters.clear()
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=True, cuda_graphs=True, keep_logits=True,
                               max_num_batched_tokens=8, capture_sizes=[1, 2, 4])
    tokens, logits = serve(engine)
    assert tokens == ref_tokens
    assert max_logit_error(logits, ref_logits) <= LOGITS_ATOL
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    assert engine.runner.counts["graph"] > 0 and engine.blocks_in_use() == dict.fromkeys(engine.blocks_in_use(), 0)


def test_eager_engine_matches_transformers_without_runner(family):
    _, model, _, (ref_tokens, ref_logits) = family
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=False, cuda_graphs=False, keep_logits=True,
                               max_num_batched_tokens=8)
    tokens, logits = serve(engine)
    assert tokens == ref_tokens and max_logit_error(logits, ref_logits) <= LOGITS_ATOL


def test_compiled_engine_without_runner_traces_the_models_floats_as_constants(family, monkeypatch):
    """Without graphs the engine calls its own torch.compile(dynamic=True) step: the model's floats
    (RMSNorm eps, rotary scaling) must reach the graph as constants, not float64 CPU inputs."""
    _, model, _, (ref_tokens, _) = family
    torch._dynamo.reset()
    recorder = record_compiles(monkeypatch)
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=True, cuda_graphs=False,
                               keep_logits=True, max_num_batched_tokens=8)
    tokens, _ = serve(engine)
    assert tokens == ref_tokens and recorder.graphs
    assert all((torch.float64, "cpu") not in inputs for inputs in recorder.graphs), recorder.graphs
    torch._dynamo.reset()


def test_generate_returns_the_new_tokens_of_every_prompt(family):
    _, model, _, (ref_tokens, _) = family
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=False, cuda_graphs=False)
    assert engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == ref_tokens
    eos = ref_tokens[0][1]
    stop = ref_tokens[0].index(eos) + 1  # the EOS token ends the request and is returned
    assert engine.generate(PROMPTS[:1], max_new_tokens=3, eos_token_id=eos) == [ref_tokens[0][:stop]]
    # a numpy int is one stop token, as an int is
    assert engine.generate(PROMPTS[:1], max_new_tokens=3, eos_token_id=np.int64(eos)) == [ref_tokens[0][:stop]]
    # a batch with a prompt no cache could hold queues nothing: the next generate serves its own prompts only
    with pytest.raises(ValueError, match=r"prompts\[1\]: a request of 300 prompt"):
        engine.generate([PROMPTS[0], [1] * 300], max_new_tokens=NEW_TOKENS)
    assert not engine.has_unfinished() and not engine._outputs
    # so does a batch with an id past the vocabulary, which the step's embedding would fail on
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"^prompts\[1\]: token id {vocab} is past the model's vocabulary of "
                                         rf"{vocab} \(its input embeddings\)"):
        engine.generate([PROMPTS[0], [1, vocab, 2]], max_new_tokens=NEW_TOKENS)
    assert not engine.has_unfinished() and not engine._outputs
    assert engine.generate(PROMPTS[:1], max_new_tokens=NEW_TOKENS) == ref_tokens[:1]
    # an output is popped once its request finished: a running one's next step still records into it
    first, second = (engine.add_request(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS[:2])
    engine.step()
    with pytest.raises(ValueError, match=rf"^request {first} is still running: pop its output once it finished"):
        engine.pop_output(first)
    while engine.has_unfinished():
        engine.step()
    assert [engine.pop_output(r).output_tokens for r in (first, second)] == ref_tokens[:2]


def drop_window(model):
    for m in ca_hf.attention_modules(model):
        if hasattr(m, "sliding_window"):
            m.sliding_window = None
    model.config.sliding_window = None  # Mistral passes its config's window to every layer


def drop_cap(model):
    for m in ca_hf.attention_modules(model):
        m.attn_logit_softcapping = None


def drop_scale(model):
    for m in ca_hf.attention_modules(model):
        m.scaling = m.head_dim**-0.5


@pytest.mark.parametrize(("family_name", "drop"), [
    ("qwen2", drop_window), ("mistral", drop_window), ("gemma2", drop_window), ("gemma2", drop_cap),
    ("gemma2", drop_scale),
], ids=["qwen2-window", "mistral-window", "gemma2-window", "gemma2-cap", "gemma2-scale"])
def test_negative_controls_fail_the_comparison(family_name, drop):
    """The same weights with a window, the soft-cap or the scale dropped (the engine reads what the
    model says) no longer agree with transformers: the comparison above can fail."""
    model = hf_random.random_model(hf_random.random_config(family_name), seed=1)
    ref_tokens, ref_logits = transformers_reference(hf_random.eager_twin(model))
    drop(model)
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=False, cuda_graphs=False, keep_logits=True,
                               max_num_batched_tokens=8)
    tokens, logits = serve(engine)
    assert max_logit_error(logits, ref_logits) > 100 * LOGITS_ATOL


def test_window_groups_hold_only_their_windows_blocks():
    model = hf_random.random_model(hf_random.random_config("qwen2"), seed=1)
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=False, cuda_graphs=False,
                               max_batch_size=4, max_num_batched_tokens=8)
    # the window group's caches hold what 4 rolling tables can: 4 x window_blocks + the null block
    assert {g.name: g.spec.num_blocks for g in engine.groups} == {"full": 64, "window6": 4 * 5 + 1}
    assert engine.kv_caches[1].shape[1] == 21 and engine.kv_caches[0].shape[1] == 64
    rid = engine.add_request(list(range(1, 41)), max_new_tokens=8)
    held = []
    while engine.has_unfinished():
        engine.step()
        held.append(engine.blocks_in_use())
    assert max(h["full"] for h in held) == 12  # 47 tokens fed
    assert max(h["window6"] for h in held) <= window_blocks(6, 8, 4) == 5
    assert held[-1] == {"full": 0, "window6": 0} and engine.output(rid).finish_reason == "length"


def test_a_request_that_cannot_fit_says_how_to_fix_it():
    model = hf_random.random_model(hf_random.random_config("llama"))
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=8, compile=False, cuda_graphs=False)
    with pytest.raises(ValueError, match="raise num_blocks"):
        engine.add_request(list(range(40)), max_new_tokens=4)


# ---------------------------------------------------------------------------------------------
# CPU: FLASHINFER and XFORMERS host paths (planning per group, rolling tables) with float64
# stand-ins for their kernels, against transformers


@pytest.fixture
def stand_in_kernels(monkeypatch):
    from test_flashinfer import DENSE_FLASHINFER
    from test_xformers import dense_float64_kernel

    monkeypatch.setattr(fib, "_flashinfer", lambda: DENSE_FLASHINFER)
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(xformers_ops, "run_xformers", dense_float64_kernel)
    for cls in (FlashInferBackend, XFormersBackend):  # CPU and fp32, for the stand-ins
        monkeypatch.setattr(cls, "unavailable_reason", classmethod(lambda cls: None))
        monkeypatch.setattr(cls, "supported_dtypes", (*cls.supported_dtypes, torch.float32))
        monkeypatch.setattr(cls, "requires_cuda", False)


@pytest.mark.parametrize(("family_name", "backend", "block_size", "compile"), [
    ("gemma2", "FLASHINFER", 4, True), ("qwen2", "FLASHINFER", 4, False), ("mistral", "XFORMERS", 64, False),
])
def test_backend_host_paths_match_transformers_with_stand_in_kernels(stand_in_kernels, family_name, backend,
                                                                      block_size, compile):
    config = hf_random.random_config(family_name, "small", num_hidden_layers=3, sliding_window=6)
    model = hf_random.random_model(config, seed=2)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(n)] for i, n in enumerate((70, 9, 75))]  # 70+: a 64-block rolls
    ref_tokens, ref_logits = transformers_reference(hf_random.eager_twin(model, torch.float64), prompts, 4)
    torch._dynamo.reset()
    counters.clear()
    engine = ca_hf.PagedEngine(model, block_size=block_size, num_blocks=24, backend=backend, compile=compile,
                               cuda_graphs=True, keep_logits=True, max_num_batched_tokens=64, capture_sizes=[1, 2, 4])
    tokens, logits = serve(engine, prompts, 4)
    assert engine.backend.get_name() == backend and len(engine.groups) == (1 if family_name == "mistral" else 2)
    assert tokens == ref_tokens and max_logit_error(logits, ref_logits) <= 1e-4  # fp32 model, float64 kernels
    assert engine.runner.counts["graph"] > 0
    if compile:  # FlashInfer's ops with one plan per group: still one graph, no breaks
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


# ---------------------------------------------------------------------------------------------
# GPU (bf16): every backend that serves the model, against transformers' eager attention in float64


def gpu_cases():
    for family_name in hf_random.FAMILIES:
        for backend in ca.registry.BACKEND_CLASSES():
            if backend == "XFORMERS" and family_name == "gemma2":
                continue  # no soft-cap on xFormers
            yield pytest.param(family_name, backend, marks=[pytest.mark.gpu, pytest.mark.long(80)],
                               id=f"{family_name}-{backend}")


@pytest.mark.parametrize(("family_name", "backend"), list(gpu_cases()))
def test_gpu_bf16_matches_transformers_float64_teacher_forced(family_name, backend):
    """The product path (compiled, decode steps replayed as CUDA graphs, prefills and chunks
    eager), teacher-forced against the float64 model under transformers' eager attention."""
    cls = ca.registry.BACKEND_CLASSES()[backend]
    if cls.unavailable_reason() is not None:
        pytest.skip(f"{backend}: {cls.unavailable_reason()}")
    # Every engine compiles the same step code; in one xdist worker, five of them passed Dynamo's
    # recompile limit of 8 entries per code object (H100 run): start each case from a clean cache.
    torch._dynamo.reset()
    block_size = 64 if backend == "XFORMERS" else 16
    config = hf_random.random_config(family_name, "small", sliding_window=40)
    model = hf_random.random_model(config, dtype=torch.bfloat16, device="cuda", seed=3)
    ref = hf_random.eager_twin(model, torch.float64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in (100, 7, 57, 140, 33)]
    engine = ca_hf.PagedEngine(model, block_size=block_size, num_blocks=64, backend=backend, compile=True,
                               cuda_graphs=True, keep_logits=True, max_num_batched_tokens=128,
                               capture_sizes=[1, 2, 4, 8], max_seq_len_to_capture=256)
    tokens, logits = serve(engine, prompts, 24, late=2)
    for p, t, lg in zip(prompts, tokens, logits, strict=True):
        ref_logits = ref(torch.tensor([p + t], device="cuda")).logits[0, len(p) - 1 : -1].cpu()
        err = ((lg.double() - ref_logits).norm() / ref_logits.norm()).item()
        assert err <= 3e-2, (family_name, backend, err)
    assert engine.runner.counts["graph"] > 0


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_generate_serves_a_random_model(capsys):
    from compiled_attn import __main__ as cli

    argv = ["generate", "--random", "qwen2", "--size", "tiny", "--num-prompts", "3", "--prompt-len", "9",
            "--max-new-tokens", "4", "--block-size", "4", "--no-compile"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "summary: 12 tokens in" in out and "tok/s after the first step" in out and "full x1, window6 x2" in out


def test_cli_generate_refuses_a_folder_without_a_config(tmp_path):
    from compiled_attn import __main__ as cli

    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tmp_path)])
    assert e.value.code == 2


def test_cli_generate_refuses_prompt_texts_for_a_folder_without_a_tokenizer(tmp_path, monkeypatch, capsys):
    """--prompt with a model folder that holds no tokenizer: a usage error before the model loads."""
    from compiled_attn import __main__ as cli
    from compiled_attn.integrations import generate

    hf_random.random_model(hf_random.random_config("llama", "tiny")).save_pretrained(tmp_path)
    monkeypatch.setattr(generate, "load_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tmp_path), "--prompt", "hello"])
    assert e.value.code == 2
    assert f"--prompt needs a tokenizer, and {str(tmp_path)!r} holds none" in capsys.readouterr().err


@pytest.mark.parametrize(("prompt", "error"), [
    ("", "--prompt '' encodes to no token"),
    ("w150", "--prompt 'w150' encodes to token id 150, past the model's vocabulary of 128"),
], ids=["empty", "past-vocab"])
def test_cli_generate_refuses_prompts_the_engine_would_refuse_before_the_model_loads(tmp_path, monkeypatch, capsys,
                                                                                   prompt, error):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from compiled_attn import __main__ as cli
    from compiled_attn.integrations import generate

    config = hf_random.random_config("llama", "tiny")
    assert config.vocab_size == 128
    hf_random.random_model(config).save_pretrained(tmp_path)
    words = models.WordLevel({f"w{i}": i for i in range(200)} | {"[UNK]": 0}, unk_token="[UNK]")
    tokenizer = Tokenizer(words)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(tmp_path)
    monkeypatch.setattr(generate, "load_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(tmp_path), "--prompt", "w5 w7", "--prompt", prompt])
    assert e.value.code == 2
    assert error in capsys.readouterr().err


def test_engine_sizes_are_checked_before_a_window_group_derives_its_blocks():
    model = hf_random.random_model(hf_random.random_config("mistral"))
    for kw, error in ((dict(block_size=0), "block_size must be >= 1, got 0"),
                      (dict(max_batch_size=2.5), "max_batch_size must be an int, got 2.5"),
                      (dict(max_num_batched_tokens=8.0), "max_num_batched_tokens must be an int, got 8.0")):
        with pytest.raises(ValueError, match=f"^{re.escape(error)}$"):
            ca_hf.PagedEngine(model, compile=False, cuda_graphs=False, **kw)


def test_a_generator_of_prompts_is_served_like_a_list():
    model = hf_random.random_model(hf_random.random_config("llama", "tiny"))
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=False, cuda_graphs=False)
    prompts = [[5, 6], [7, 8, 9]]
    want = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=False, cuda_graphs=False).generate(prompts, 3)
    assert engine.generate(iter(prompts), 3) == want


def test_settings_transformers_passes_must_equal_what_the_engine_read():
    model = hf_random.random_model(hf_random.random_config("gemma2"))
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=False, cuda_graphs=False)
    ca_hf.attention_modules(model)[1].attn_logit_softcapping = 3.0  # changed behind the engine's back
    engine.add_request([1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="teach layer_settings"):
        engine.step()


def test_models_the_engine_cannot_serve_are_refused_naming_why():
    model = hf_random.random_model(hf_random.random_config("llama"))
    modules = ca_hf.attention_modules(model)
    modules[1].is_causal = False  # a bidirectional layer
    with pytest.raises(ValueError, match="layer 1 is not causal: PagedEngine serves decoder-only causal LMs"):
        ca_hf.PagedEngine(model, compile=False, cuda_graphs=False)
    modules[1].is_causal, modules[2].layer_idx = True, 5
    with pytest.raises(ValueError, match=r"attention layer indices \[0, 1, 5\] are not 0\.\.2"):
        ca_hf.PagedEngine(model, compile=False, cuda_graphs=False)
    modules[2].layer_idx = 2
    # float64: no backend's dtypes (each backend named with its reason)
    with pytest.raises(NotImplementedError, match=r"no backend serves every layer group of this model: .*"
                                                  r"'TORCH_SDPA': 'TORCH_SDPA supports dtypes .*not torch\.float64; "
                                                  r"no registered backend does'"):
        ca_hf.PagedEngine(model.double(), compile=False, cuda_graphs=False)
    with pytest.raises(ValueError, match="found no attention modules .* in Linear"):
        ca_hf.attention_modules(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["llama4-chunked", "gpt-oss-sinks"])
def test_layers_transformers_limits_by_a_mask_or_sinks_are_refused(family):
    """Llama4's chunked layers exist only as a mask, which never reaches this implementation, and
    gpt-oss passes its sinks as a keyword the paged kernels cannot take: each was served with
    other numerics (logits 2-4 off) before the engine refused it."""
    import transformers as tr

    sizes = dict(hf_random.SIZES["tiny"], max_position_embeddings=4096)
    if family == "llama4-chunked":
        config = tr.Llama4TextConfig(**sizes, attention_chunk_size=6, num_local_experts=1, interleave_moe_layer_step=1,
                                     intermediate_size_mlp=128, no_rope_layers=[1, 0, 1])
        error = r"layer 0 is a 'chunked_attention' layer: PagedEngine serves full and sliding-window causal"
    else:
        config = tr.GptOssConfig(**sizes, num_local_experts=2, num_experts_per_tok=1, sliding_window=6,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        error = "layer 0 has attention sinks: PagedEngine's kernels have none"
    model = hf_random.random_model(config, seed=1)
    with pytest.raises(ValueError, match=f"^{error}"):
        ca_hf.PagedEngine(model, block_size=4, num_blocks=128, compile=False, cuda_graphs=False)


def test_sinks_passed_to_the_attention_function_are_refused():
    model = hf_random.random_model(hf_random.random_config("llama", "tiny"))
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=64, compile=False, cuda_graphs=False)
    module = ca_hf.attention_modules(model)[0]
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(ValueError, match=r"^layer 0 was given attention sinks \(s_aux\)"):
        ca_hf.attention_forward(module, q, q[:, :2], q[:, :2], None, s_aux=torch.zeros(4),
                                **{ca_hf.CACHES_KWARG: engine.kv_caches})


def test_a_mask_or_dropout_the_engine_would_ignore_is_refused():
    """transformers passes no mask to this implementation; one that arrives anyway (the model's own
    chunked or bidirectional attention, a caller's 4-D mask) or attention dropout would be ignored
    by the paged step: both raise instead of changing the numerics silently."""
    model = hf_random.random_model(hf_random.random_config("llama"))
    engine = ca_hf.PagedEngine(model, block_size=4, num_blocks=16, compile=False, cuda_graphs=False)
    module = ca_hf.attention_modules(model)[0]
    c = model.config
    q = torch.randn(1, c.num_attention_heads, 3, module.head_dim)
    kv = torch.randn(1, c.num_key_value_heads, 3, module.head_dim)
    call = dict(scaling=module.scaling, **{ca_hf.CACHES_KWARG: engine.kv_caches})
    with pytest.raises(ValueError, match="attention mask"):
        ca_hf.attention_forward(module, q, kv, kv, torch.ones(1, 1, 3, 3, dtype=torch.bool), **call)
    with pytest.raises(ValueError, match="dropout"):
        ca_hf.attention_forward(module, q, kv, kv, None, dropout=0.1, **call)


def test_an_empty_backend_name_is_unknown_not_auto(monkeypatch):
    """As `get_attn_backend`: only None means "pick one"; an empty name given is refused."""
    monkeypatch.setenv("COMPILED_ATTN_BACKEND", "TORCH_SDPA")
    spec = ca.AttentionSpec(num_heads=4, num_kv_heads=2, head_size=16, block_size=16, num_blocks=8,
                            dtype=torch.float32, device="cpu")
    assert ca_hf.pick_backend(None, [spec]).get_name() == "TORCH_SDPA"
    with pytest.raises(ValueError, match="unknown attention backend ''"):
        ca_hf.pick_backend("", [spec])


def test_random_config_overrides_the_familys_own_settings():
    config = hf_random.random_config("gemma2", max_position_embeddings=4096, query_pre_attn_scalar=16,
                                     attn_logit_softcapping=None)
    assert (config.max_position_embeddings, config.query_pre_attn_scalar, config.attn_logit_softcapping) == (
        4096, 16, None)
    assert hf_random.random_config("qwen2", max_window_layers=2).max_window_layers == 2


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_run_generate_reports_token_ids_without_a_tokenizer(max_new_tokens):
    """The CLI's generate on random weights (no tokenizer): the row holds each prompt's new token
    ids, those `PagedEngine.generate` gives for the same prompts with no stop token (random
    weights' config EOS, 2 for llama, comes up by chance: the first prompt's first token here),
    and no steady rate for a run of one step."""
    from compiled_attn.integrations.generate import run_generate

    row = run_generate(family="llama", size="tiny", num_prompts=2, prompt_len=4, max_new_tokens=max_new_tokens,
                       compile=False, cuda_graphs=False, progress=False, seed=3)
    g = torch.Generator().manual_seed(3)
    model = hf_random.random_model(hf_random.random_config("llama", "tiny"))
    prompts = [torch.randint(1, model.config.vocab_size, (4,), generator=g).tolist() for _ in range(2)]
    engine = ca_hf.PagedEngine(model, block_size=16, num_blocks=8, compile=False, cuda_graphs=False)
    want = engine.generate(prompts, max_new_tokens=max_new_tokens)
    assert row["token ids"] == want and want[0][0] == model.generation_config.eos_token_id == 2
    assert "texts" not in row and row["new tokens"] == 2 * max_new_tokens
    assert (row["steady tok/s"] is None) == (max_new_tokens == 1)


def test_run_generate_stops_a_model_folders_requests_at_its_generation_config_eos(tmp_path):
    """--model DIR: each request stops at the checkpoint's generation_config.eos_token_id (a list
    here, as instruct checkpoints ship), as transformers' generate does; the EOS is returned."""
    from compiled_attn.integrations.generate import run_generate

    model = hf_random.random_model(hf_random.random_config("llama", "tiny"))
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    args = dict(model_dir=str(tmp_path), num_prompts=2, prompt_len=4, max_new_tokens=4, compile=False,
                cuda_graphs=False, progress=False, seed=5)
    free = run_generate(**args)["token ids"]
    stop = free[0][1]  # prompt 0's second new token
    model.generation_config.eos_token_id = [127, stop]
    model.save_pretrained(tmp_path)
    stopped = run_generate(**args)["token ids"]
    assert stopped == [o[: o.index(stop) + 1] if stop in o else o for o in free] and stopped[0] == free[0][:2]


@pytest.mark.parametrize(("config_eos", "tokenizer_eos", "want"),
                         [([2, 116], 2, [2, 116]), (5, 2, 5), (None, 2, 2), (None, None, None)])
def test_generate_stops_where_transformers_generate_does(config_eos, tokenizer_eos, want):
    """The CLI's stop tokens: the checkpoint's generation_config.eos_token_id (instruct
    checkpoints list several), else the tokenizer's EOS, else none."""
    from types import SimpleNamespace

    from compiled_attn.integrations.generate import stop_token_ids

    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=config_eos))
    assert stop_token_ids(model, SimpleNamespace(eos_token_id=tokenizer_eos)) == want
    assert stop_token_ids(model, None) == config_eos

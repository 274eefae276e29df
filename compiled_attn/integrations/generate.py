"""`python -m compiled_attn generate`: serve a transformers model through `PagedEngine`.

The model is a local directory (`--model DIR`, loaded with `from_pretrained`; its tokenizer, if
it has one, encodes `--prompt` texts and decodes the outputs) or a random-weight model of one of
`hf_random.FAMILIES` (`--random llama`): no hub access is needed. Prompts are the given texts or
random token ids; a progress bar counts generated tokens, and the summary reports tokens/s.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from compiled_attn.integrations import hf_random
from compiled_attn.integrations import transformers as ca_hf


def load_model(model_dir: str | None, family: str | None, size: str, dtype: torch.dtype,
               device: torch.device) -> tuple[Any, Any]:
    """(model with attn_implementation="compiled_attn", tokenizer or None)."""
    ca_hf.register()
    if family is not None:
        return hf_random.random_model(hf_random.random_config(family, size), dtype=dtype, device=device), None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=ca_hf.IMPLEMENTATION, dtype=dtype)
    return model.to(device).eval(), load_tokenizer(model_dir)


def load_tokenizer(model_dir: str) -> Any:
    """The folder's tokenizer, or None for a folder with weights only (random prompts, token ids out)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None


def prompt_ids_problem(model_dir: str, prompts: list[str]) -> str | None:
    """What is wrong with serving `prompts` from the model folder, before its weights load: no
    tokenizer, a text that encodes to no token, or an id past the config's vocabulary (the
    engine would refuse each after building itself). None if nothing is."""
    from transformers import AutoConfig

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        return (f"--prompt needs a tokenizer, and {model_dir!r} holds none: use --num-prompts / --prompt-len for "
                "random prompts")
    vocab = AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size
    for text in prompts:
        ids = tokenizer(text)["input_ids"]
        if not ids:
            return f"--prompt {text!r} encodes to no token: give a text with at least one"
        if max(ids) >= vocab:
            return (f"--prompt {text!r} encodes to token id {max(ids)}, past the model's vocabulary of {vocab}: the "
                    "folder's tokenizer does not belong to its model")
    return None


def stop_token_ids(model: Any, tokenizer: Any) -> int | list[int] | None:
    """The ids a request stops at, as transformers' `generate` picks them: the checkpoint's
    `generation_config.eos_token_id` (an id or a list: instruct checkpoints list several), else
    the tokenizer's EOS; None (stop at max_new_tokens only) when neither names one."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    return eos if eos is not None else getattr(tokenizer, "eos_token_id", None)


def run_generate(*, model_dir: str | None = None, family: str | None = None, size: str = "small",
                 prompts: list[str] | None = None, num_prompts: int = 8, prompt_len: int = 64,
                 max_new_tokens: int = 64, backend: str | None = None, block_size: int = 16,
                 num_blocks: int | None = None, compile: bool = True, cuda_graphs: bool = True, seed: int = 0,
                 progress: bool = True) -> dict[str, Any]:
    """Serve the prompts; returns the summary row: tokens/s over the whole run (first step, with
    its compiles, included) and after the first step ("steady tok/s": the serving rate)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model, tokenizer = load_model(model_dir, family, size, dtype, device)
    if prompts and tokenizer is None:
        raise ValueError("--prompt needs a model folder with a tokenizer; use --num-prompts for random prompts")
    if prompts:
        ids = [tokenizer(p)["input_ids"] for p in prompts]
    else:
        g = torch.Generator().manual_seed(seed)
        ids = [torch.randint(1, model.config.vocab_size, (prompt_len,), generator=g).tolist()
               for _ in range(num_prompts)]
    longest = max(len(p) for p in ids) + max_new_tokens
    blocks = num_blocks or len(ids) * -(-longest // block_size) + 1
    start = time.perf_counter()
    engine = ca_hf.PagedEngine(model, block_size=block_size, num_blocks=blocks, backend=backend, compile=compile,
                               cuda_graphs=cuda_graphs, max_batch_size=max(len(ids), 1),
                               max_seq_len_to_capture=-(-longest // block_size) * block_size)
    setup_s = time.perf_counter() - start
    # a checkpoint's stop tokens; random weights have none worth stopping at (their config's EOS id
    # comes up by chance) and a throughput run serves every prompt its max_new_tokens
    eos = stop_token_ids(model, tokenizer) if model_dir is not None else None
    rids = [engine.add_request(p, max_new_tokens, eos) for p in ids]
    bar = _bar(len(ids) * max_new_tokens, progress)
    start = time.perf_counter()
    generated, first = 0, None  # first: (seconds, tokens) at the end of the first step
    while engine.has_unfinished():
        n = len(engine.step())
        generated += n
        bar.update(n)
        first = first or (time.perf_counter() - start, generated)
    seconds = time.perf_counter() - start
    bar.close()
    outputs = [engine.output(r).output_tokens for r in rids]
    row = {
        "model": model_dir or f"random {family} ({size})",
        "backend": engine.backend.get_name(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "groups": ", ".join(f"{g.name} x{len(g.layers)}" for g in engine.groups),
        "requests": len(ids),
        "new tokens": generated,
        "setup s": setup_s,
        "seconds": seconds,
        "tok/s": generated / seconds,
        "steady tok/s": (generated - first[1]) / (seconds - first[0]) if generated > first[1] else None,
    }
    if tokenizer is not None:
        row["texts"] = [tokenizer.decode(o) for o in outputs]
    else:
        row["token ids"] = outputs
    return row


class _NoBar:
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def _bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generating", unit="tok")

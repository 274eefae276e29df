"""Command-line arguments are checked when parsed: a bad one exits with usage (status 2) before
any model is built or benchmark run, never with a traceback after the run."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from compiled_attn import __main__ as cli
from compiled_attn.bench import e2e
from compiled_attn.integrations import hf_random
from compiled_attn.registry import BACKEND_CLASSES

ROOT = Path(__file__).parent.parent


def not_reached(*args, **kwargs):
    raise AssertionError("the run started before the arguments were checked")


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_runs(monkeypatch):
    import compiled_attn.bench.suite as suite
    import compiled_attn.demo as demo

    monkeypatch.setattr(demo, "run_demo", not_reached)
    monkeypatch.setattr(suite, "run_bench", not_reached)
    monkeypatch.setattr(e2e, "run", not_reached)
    monkeypatch.setattr(cli, "run_generate", not_reached)
    monkeypatch.setattr(hf_random, "random_model", not_reached)  # nothing is built either


@pytest.fixture
def a_file(tmp_path) -> str:
    path = tmp_path / "results.json"
    path.write_text("{}")
    return str(path)


BAD_MAIN_ARGS = {
    "demo_zero_steps": ["demo", "--steps", "0"],  # once: ZeroDivisionError after the whole run
    "demo_negative_steps": ["demo", "--steps", "-3"],
    "demo_steps_past_the_cache": ["demo", "--steps", "5000"],  # once: "KV cache full" mid-run
    "demo_float_steps": ["demo", "--steps", "2.5"],
    "demo_zero_tp": ["demo", "--tp", "0"],
    "demo_tp_that_splits_no_heads": ["demo", "--tp", "3"],  # once: spawned 3 processes, then failed (exit 1)
    "demo_unknown_backend": ["demo", "--backend", "FLASH"],
    "bench_unknown_suite": ["bench", "--suite", "e2ee"],  # once: ran nothing, exit 0
    "bench_unknown_backend": ["bench", "--backend", "XFORMER"],  # once: silently dropped its suite
    "generate_prompt_text_without_a_tokenizer": ["generate", "--random", "llama", "--prompt", "hi"],
    # once: exit 0, nothing run or written
    "bench_nothing_to_run": ["bench", "--backend", "TORCH_SDPA", "--suite", "decode_xformers"],
}


@pytest.mark.parametrize("argv", list(BAD_MAIN_ARGS.values()), ids=list(BAD_MAIN_ARGS))
def test_bad_arguments_exit_with_usage_before_running(no_runs, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bench_out_that_is_a_file_exits_before_running(no_runs, a_file):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--out", a_file])
    assert exit_.value.code == 2


def test_a_refused_bench_command_makes_no_out_folder(no_runs, tmp_path, capsys):
    out = tmp_path / "new" / "results"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--out", str(out), "--suite", "nope"])
    assert exit_.value.code == 2 and not (tmp_path / "new").exists()


def test_bench_out_under_a_file_exits_before_running(no_runs, a_file, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--out", os.path.join(a_file, "results")])
    assert exit_.value.code == 2
    assert f"{a_file!r} is not a folder" in capsys.readouterr().err


def test_bench_out_that_cannot_be_written_exits_before_running(no_runs, tmp_path, monkeypatch, capsys):
    # a read-only folder, as os.access reports it even to root
    monkeypatch.setattr("compiled_attn.cli.os.access", lambda path, mode, **kw: path != str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"folder {str(tmp_path)!r} is not writable" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--point", "64x"], ["--point", "0x1024"], ["--block-size", "0"],
                                  ["--backend", "nope"]],
                         ids=["point_missing_ctx", "point_zero", "block_size", "backend"])
def test_e2e_bad_arguments_exit_before_running(no_runs, argv):
    with pytest.raises(SystemExit) as exit_:
        e2e.main(argv)
    assert exit_.value.code == 2


@pytest.mark.parametrize("bad", ["64x", "0x1024", "64x1024x2", "ax1024"])
def test_decode_loop_and_profile_bad_points_exit_before_running(monkeypatch, bad):
    """`--point` is parsed as BxCTX (`cli.point`) by every entry point that takes one; it was split
    by hand after parsing in two of them (a traceback on "64x")."""
    from compiled_attn.bench import decode_loop

    monkeypatch.setattr(decode_loop, "run", not_reached)
    monkeypatch.setattr(decode_loop, "build_8b", not_reached)
    for main in (decode_loop.main, script("profile_decode").main):
        with pytest.raises(SystemExit) as exit_:
            main(["--point", bad])
        assert exit_.value.code == 2


@pytest.mark.parametrize("bad", ["no_such_option=1", "triton.no_such=1", "combo_kernels", "combo_kernels=yes"])
def test_inductor_option_scripts_refuse_bad_options_before_running(monkeypatch, bad):
    """`--ab-option` / `--set` are parsed as Inductor options (`cli.inductor_option`): a key
    torch._inductor.config lacks, no "=", or a value that is not a Python literal exits with usage."""
    from compiled_attn.bench import decode_loop

    monkeypatch.setattr(decode_loop, "build_8b", not_reached)
    for main, flag in ((script("profile_decode").main, "--ab-option"), (script("tuning_probe").main, "--set")):
        with pytest.raises(SystemExit) as exit_:
            main(["--point", "1x1024", flag, bad])
        assert exit_.value.code == 2


def test_inductor_option_reads_nested_keys_and_literals():
    from compiled_attn.cli import inductor_option

    assert inductor_option("triton.enable_pdl=True") == ("triton.enable_pdl", True)
    assert inductor_option("coordinate_descent_search_radius=2") == ("coordinate_descent_search_radius", 2)
    assert script("tuning_probe").option_set("combo_kernels=True, coordinate_descent_tuning=False") == {
        "combo_kernels": True, "coordinate_descent_tuning": False}
    assert script("tuning_probe").option_set("") == {}


@pytest.mark.parametrize("bad", [["--iters", "0"], ["--tp", "0"], ["--batch", "-1"], ["--out", "FILE"]],
                         ids=["iters", "tp", "batch", "out_is_a_file"])
def test_tp_bench_bad_arguments_exit_before_running(monkeypatch, a_file, bad):
    tp_bench = script("tp_bench")
    monkeypatch.setattr(tp_bench.distributed, "run_ranks", not_reached)
    with pytest.raises(SystemExit) as exit_:
        tp_bench.main([a if a != "FILE" else a_file for a in bad])
    assert exit_.value.code == 2


def test_fault_hunt_refuses_zero_examples(monkeypatch):
    hunt = script("fault_hunt")
    monkeypatch.setattr(hunt, "hunt", not_reached)
    monkeypatch.setattr(sys, "argv", ["fault_hunt.py", "TORCH_SDPA", "--examples", "0"])
    with pytest.raises(SystemExit) as exit_:
        hunt.main()
    assert exit_.value.code == 2


@pytest.mark.skipif(BACKEND_CLASSES()["FLASHINFER"].unavailable_reason() is None, reason="FlashInfer runs here")
def test_generate_with_a_backend_that_cannot_run_here_exits_before_building(no_runs, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--random", "llama", "--backend", "FLASHINFER"])
    assert exit_.value.code == 2
    assert "FLASHINFER cannot run here" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["demo", "--steps", "1"], ["generate", "--random", "llama"]])
def test_an_unknown_backend_from_the_environment_exits_before_running(command, no_runs, monkeypatch, capsys):
    """$COMPILED_ATTN_BACKEND is the backend a command would pick: checked with --backend's rules."""
    monkeypatch.setenv("COMPILED_ATTN_BACKEND", "flash")
    with pytest.raises(SystemExit) as exit_:
        cli.main(command)
    assert exit_.value.code == 2
    assert "unknown attention backend 'flash' (from $COMPILED_ATTN_BACKEND)" in capsys.readouterr().err


def test_generate_with_a_block_size_its_backend_cannot_serve_exits_before_building(no_runs, monkeypatch, capsys):
    xformers = BACKEND_CLASSES()["XFORMERS"]
    monkeypatch.setattr(xformers, "unavailable_reason", classmethod(lambda cls: None))  # as if on a GPU with it
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--random", "llama", "--backend", "XFORMERS", "--block-size", "16"])
    assert exit_.value.code == 2
    assert "XFORMERS cannot serve --block-size 16: use --block-size 64" in capsys.readouterr().err


@pytest.mark.parametrize(("out", "says"), [("", "an empty name is no folder"), ("dangling", "is not a folder")])
def test_bench_out_that_names_no_folder_exits_before_running(out, says, no_runs, tmp_path, capsys):
    """An empty name, or a link to nothing (os.makedirs would find it in the way)."""
    if out:
        out = str(tmp_path / out)
        os.symlink(tmp_path / "nothing", out)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--out", out])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err

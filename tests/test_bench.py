"""CPU checks of the bench's result handling: tables and plots (the suites themselves need CUDA)."""

from __future__ import annotations

from compiled_attn.__main__ import print_table
from compiled_attn.bench.plots import decode_series


def test_plots_draw_the_decode_grid_only():
    fi = "compiled_attn.bench.decode_flashinfer"
    xf = "compiled_attn.bench.decode_xformers"
    results = {
        fi: [
            {"suite": "decode_flashinfer", "impl": "ours (graph)", "batch": 8, "ctx": 512, "page": 16, "us": 12.0,
             "hbm_frac": 0.5},
            {"suite": "decode_flashinfer", "impl": "torch sdpa", "batch": 8, "ctx": 512, "page": None, "us": 9.0,
             "hbm_frac": 0.7},
            {"suite": "page_sweep_flashinfer", "impl": "ours (graph)", "batch": 8, "ctx": 1024, "page": 64,
             "us": 20.0, "hbm_frac": 0.6},
        ],
        xf: [
            {"suite": "decode_xformers", "variant": "ours", "batch": 8, "ctx": 512, "time_us": 11.0, "hbm_frac": 0.55},
            {"suite": "prefill_xformers", "variant": "fresh", "batch": 8, "ctx": 2048, "time_us": 1800.0},
        ],
    }
    assert decode_series(results) == {
        "FlashInfer: ours (graph)": [(8, 512, 12.0, 0.5)],
        "torch SDPA, static cache": [(8, 512, 9.0, 0.7)],
        "xFormers: ours": [(8, 512, 11.0, 0.55)],
    }


def test_table_has_a_column_for_every_key_of_any_row(capsys):
    print_table([{"ceiling": "amax", "GB/s": 2781.7}, {"ceiling": "matmul", "TFLOP/s": 777.26}])
    header, amax, matmul = capsys.readouterr().out.splitlines()
    assert header.split() == ["ceiling", "GB/s", "TFLOP/s"]
    assert amax.split() == ["amax", "2782"] and matmul.split() == ["matmul", "777.3"]  # blank where absent
    assert amax.index("2782") == header.index("GB/s") and matmul.index("777.3") == header.index("TFLOP/s")

"""Benchmark suites behind `python -m compiled_attn bench`."""

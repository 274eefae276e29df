#!/usr/bin/env bash
# Add to .whl/ (run from the project root after the device pack) what the trimmed pack leaves out:
# - FlashInfer's XQA kernel sources (.whl/fi-xqa-src.tar.xz): the decode variants' "xqa" row
#   (compiled_attn.bench.decode_flashinfer --variants) JIT-compiles them; scripts/gpu_check.sh
#   unpacks them over the installed FlashInfer;
# - the cudnn-frontend wheel: FLASHINFER's graphed decode runs cuDNN's paged SDPA through it when
#   chosen (COMPILED_ATTN_FLASHINFER_GRAPH_DECODE=cudnn; the default is our Triton kernel: backends/
#   flashinfer.py, `graph_decode_kernel`), as the decode variants' cuDNN rows do; .whl/setup.sh
#   installs every wheel.
set -euo pipefail
version=$(tar tJf .whl/flashinfer-*.tar.xz | sed -n 's|^flashinfer_python-\(.*\)\.dist-info/$|\1|p' | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "flashinfer-python==$version"
(cd "$tmp" && unzip -q ./*.whl 'flashinfer/data/csrc/xqa/*' && tar cJf fi-xqa-src.tar.xz flashinfer/data/csrc/xqa)
cp "$tmp/fi-xqa-src.tar.xz" .whl/
# the device's Python (3.12, x86-64 manylinux), whatever this machine runs
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .whl nvidia-cudnn-frontend
ls -la .whl/fi-xqa-src.tar.xz .whl/nvidia_cudnn_frontend-*.whl

#!/usr/bin/env bash
# Add FlashInfer's XQA kernel sources to .whl/ (run from the project root after the device pack):
# the trimmed FlashInfer there keeps only the attention/page sources, and the decode variants'
# "xqa" row (compiled_attn.bench.decode_flashinfer --variants) JIT-compiles these. scripts/gpu_check.sh
# unpacks .whl/fi-xqa-src.tar.xz over the installed FlashInfer when it is there.
set -euo pipefail
version=$(tar tJf .whl/flashinfer-*.tar.xz | sed -n 's|^flashinfer_python-\(.*\)\.dist-info/$|\1|p' | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "flashinfer-python==$version"
(cd "$tmp" && unzip -q ./*.whl 'flashinfer/data/csrc/xqa/*' && tar cJf fi-xqa-src.tar.xz flashinfer/data/csrc/xqa)
cp "$tmp/fi-xqa-src.tar.xz" .whl/
ls -la .whl/fi-xqa-src.tar.xz

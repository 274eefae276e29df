#!/usr/bin/env bash
# Recompress the Inductor cache a device run returned (its inductor-cache.tar.xz.NN parts: fast xz
# on many threads) into .whl/, at xz -9e with the files grouped by extension (Triton's IR, PTX and
# cubins compress best beside their own kind): the twenty-first session's cache went from 24.3 to
# 11.5 MB, so that .whl/ carries it beside the cudnn-frontend wheel within the 64 MiB limit.
# About 1.5 min on a 2-core machine.
#   usage (project root): bash scripts/repack_inductor_cache.sh DIR_WITH_THE_PARTS
set -euo pipefail
src=${1:?usage: bash scripts/repack_inductor_cache.sh DIR_WITH_THE_PARTS}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat "$src"/inductor-cache.tar.xz.* | tar xJf - -C "$tmp"
bash scripts/tar_by_extension.sh "$tmp" | xz -9e -T2 > "$tmp.xz"
rm -f .whl/inductor-cache.tar.xz.*
split -b 15m -d "$tmp.xz" .whl/inductor-cache.tar.xz.
rm -f "$tmp.xz"
ls -la .whl/inductor-cache.tar.xz.*
du -sh .whl

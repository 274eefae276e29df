#!/usr/bin/env bash
# A tar of DIR's files on stdout, grouped by extension: xz finds more to share when Triton's IR,
# PTX and cubins sit beside their own kind (gpu_check.sh's Inductor cache, repack_inductor_cache.sh).
#   usage: bash scripts/tar_by_extension.sh DIR | xz ...
set -euo pipefail
cd "${1:?usage: bash scripts/tar_by_extension.sh DIR}"
find . -type f | awk -F. '{print $NF "\t" $0}' | sort | cut -f2- | tar cf - --no-recursion -T -

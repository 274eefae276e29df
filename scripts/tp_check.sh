#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (issue 8): the 2-GPU tests, the sharded demo, TP=1 vs TP=2 tokens/s.
#   device run (kind nvidia-h100-x2, carry [".whl"]):
#     source .whl/setup.sh && bash scripts/tp_check.sh; save_jit_cache
# PARTS selects what runs (default "tests demo bench"); results and logs under $OUT.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
PARTS=${PARTS:-"tests demo bench"}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/card.txt"
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), torch.cuda.device_count(), 'GPUs')" \
  | tee -a "$OUT/card.txt"
status=0
if [[ " $PARTS " == *" tests "* ]]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_tp.py \
    2>&1 | tee "$OUT/tp-tests.log" | tail -30
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" demo "* ]]; then
  timeout "${DEMO_TIMEOUT:-180}" python3 -m compiled_attn demo --tp 2 2>&1 | tee "$OUT/tp-demo.log" | tail -5
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" bench "* ]]; then
  timeout "${BENCH_TIMEOUT:-420}" python3 scripts/tp_bench.py --tp 1 2 --batch 1 64 --out "$OUT" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/tp-bench.log" | tail -12
  status=$(( status || PIPESTATUS[0] ))
fi
exit "$status"

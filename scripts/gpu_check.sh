#!/usr/bin/env bash
# The one command the device tool runs: GPU-marked tests, then benchmarks; results under $OUT.
#   device run:  source .whl/setup.sh && bash scripts/gpu_check.sh; save_jit_cache   (carry [".whl"])
# PARTS selects what runs (default: "tests fuzz bench"; "loop" profiles the 8B decode loop against
# gpt-fast's (B=64 then B=1, ctx 1024, one process each; ours per LOOP_VARIANTS, LOOP_TIMEOUT
# each point), times FlashInfer's decode variants (FA3 among
# them: a JIT build of a minute or more the first time, VARIANTS_TIMEOUT), our Triton decode's
# launch shapes (`decode_flashinfer --triton-sweep`, SWEEP_TIMEOUT) and the Triton kernels of a
# batch-1 layer, ours and the peer's (scripts/inductor_layer_kernels.py);
# "grid": the decode loop at GRID_POINTS, peer and ours in separate processes (below);
# "flex": scripts/flex_paged_probe.py (FlexAttention's decode over the paged cache vs SDPA over a
# contiguous one, then its kernels per call, profiled; FLEX_ARGS=--quick: no SPLIT_KV sweep);
# "fuzz" is the mutation fuzzer's GPU tests,
# FUZZ_EXAMPLES examples per mutation; "hunt" looks for the differential example that faults or
# mismatches on HUNT_BACKEND); "piecewise": the piecewise-graph GPU tests (tests/test_piecewise.py,
# every backend; PW_TESTS=0 skips them) and the piecewise bench suite (PW_BENCH_ARGS, default --quick:
# the first available backend; "" for all), each under its own timeout; "mixed": FLASHINFER's mixed step
# both ways (COMPILED_ATTN_FLASHINFER_MIXED's default, one prefill on both models, and split) in the
# piecewise bench's quick rows (8B, then the 16-layer forced decode; MIXED_BENCH_TIMEOUT); "mixedhost":
# the same through scripts/profile_runner_host.py (16 layers, host time and cProfile; MIXED_HOST_TIMEOUT;
# one device call each); "capture": the 8B runner's first and warm captures, every bucket and decode size
# (issue 14's <= 10 s warm; CAPTURE_BACKEND, default FLASHINFER; CAPTURE_TIMEOUT); "hf": the transformers
# integration's GPU tests (HF_TEST_ARGS narrows them, e.g. "-k FLASHINFER"); "hfbench":
# `bench.hf_engine`, the parts in HF_BENCH_PARTS (default b1; b64, adapter: one per device command,
# each compiles the 8B shape several times): engine vs transformers' static cache + compile at B=1,
# vs generate_batch at B=64, vs our reference Llama through the runner; HF_ARGS for the bench, e.g.
# "--quick --backend FLASHINFER"; "--profile" with the adapter part writes both sides' kernel tables). "tests" runs every GPU test but the fuzzer's (the piecewise and
# transformers ones too); PYTEST_ARGS narrows them. INDUCTOR_CACHE=1 carries Inductor's caches
# between runs (below); CLOCK_LOG=1 logs the card's clocks, temperature and power once a second
# ($OUT/clocks.csv); GRID_ORDER="ours peer" runs the grid's sides in that order. "autotune": which
# kernels a warm process tunes again (scripts/autotune_probe.py: PROBE_SUITE, default decode_loop,
# run cold then warm on a fresh cache; PROBE_ARGS e.g. "--torch-recheck"; ~5 min). "phases": the
# runner's own host time on the decode-graph path, phase by phase (scripts/runner_phases.py,
# PHASES_ARGS e.g. "--points 64x1024"). "pdl": Inductor's programmatic dependent launch
# (TORCHINDUCTOR_ENABLE_PDL, off by default in torch) for our side of the decode loop at PDL_POINT
# (default 64x1024), one compile a value in PDL_ORDER (default "0 1"; PDL_TIMEOUT each: a cold compile
# and its tuning take 70-100 s on an H200), then (unless PDL_TESTS=0) the compiled runner's
# greedy-token GPU tests with it.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
PARTS=${PARTS:-"tests fuzz bench"}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/card.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee -a "$OUT/card.txt"
status=0
# FlashInfer's XQA sources (the decode variants' "xqa" row), absent from the trimmed package:
# scripts/pack_extras.sh makes .whl/fi-xqa-src.tar.xz; setup.sh installed FlashInfer in /tmp/site
if [[ -f .whl/fi-xqa-src.tar.xz ]]; then tar xJf .whl/fi-xqa-src.tar.xz -C /tmp/site; fi
# INDUCTOR_CACHE=1: Inductor's and Triton's caches (compiled graphs, kernels, coordinate-descent
# results) live in /tmp/inductor-cache, loaded from the carried .whl/inductor-cache.tar.xz.NN and
# written back as $OUT/inductor-cache.tar.xz.NN (15 MB parts: `bash scripts/repack_inductor_cache.sh
# DIR` recompresses them into .whl/ at about half the size, as the FlashInfer JIT cache). A warm
# cache skips recompiles, and it also replays the cached tuning draws: a peer's "best of N fresh
# compiles" then times one tuning N times.
if [[ "${INDUCTOR_CACHE:-0}" == 1 ]]; then
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache TRITON_CACHE_DIR=/tmp/inductor-cache/triton
  mkdir -p "$TRITON_CACHE_DIR"
  if ls .whl/inductor-cache.tar.xz.* >/dev/null 2>&1; then
    cat .whl/inductor-cache.tar.xz.* | tar xJf - -C "$TORCHINDUCTOR_CACHE_DIR"
  fi
  save_inductor_cache() {  # fast xz on many threads; repack_inductor_cache.sh shrinks it further
    bash scripts/tar_by_extension.sh "$TORCHINDUCTOR_CACHE_DIR" | xz -T0 -6 | split -b 15m -d - "$OUT/inductor-cache.tar.xz."
    ls -la "$OUT"/inductor-cache.tar.xz.*
  }
fi
on_exit() {
  if [[ -n "${clock_pid:-}" ]]; then kill "$clock_pid" 2>/dev/null; wait "$clock_pid" 2>/dev/null; fi
  if [[ "${INDUCTOR_CACHE:-0}" == 1 ]]; then save_inductor_cache; fi
}
trap on_exit EXIT
# CLOCK_LOG=1: the card's SM / memory clocks, temperature, power and throttle reasons once a
# second into $OUT/clocks.csv while this script runs (read only). The loop also ends within a
# second of this script's death when no trap runs (SIGKILL at a time limit).
if [[ "${CLOCK_LOG:-0}" == 1 ]]; then
  query=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active
  (echo "$query"; while kill -0 $$ 2>/dev/null; do
    nvidia-smi --query-gpu="$query" --format=csv,noheader; sleep 1
  done) > "$OUT/clocks.csv" 2>&1 &
  clock_pid=$!
fi
# The GPU tests are mostly host-bound (graph capture, compiles, the soak's 10,000 steps of Python):
# WORKERS pytest-xdist processes share the one GPU (work stealing: the long soak runs start first
# and the short tests fill in around them). WORKERS=0 runs them in one process.
workers=${WORKERS:-6}
xdist=()
if [[ "$workers" != 0 ]] && python3 -c "import xdist" 2>/dev/null; then
  xdist=(-n "$workers" --dist worksteal)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / workers ))}  # float64 references on the CPU: no oversubscription
fi
if [[ " $PARTS " == *" tests "* ]]; then
  # SIGINT at the limit (to the process group, xdist workers included): pytest stops and still
  # prints its summary, naming the failures so far; the status is then timeout's 124
  # -v: a line per finished test (worker, outcome), so that a run stopped at its limit names what
  # never finished (the seventeenth session's stopped run had 67 tests unaccounted for)
  timeout -s INT -k 60 "${TEST_TIMEOUT:-560}" python3 -m pytest -m gpu -v -rfEs -p no:cacheprovider --durations=25 "${xdist[@]}" \
    --ignore=tests/test_fuzz.py ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ " $PARTS " == *" phases "* ]]; then  # where the runner's own host time goes, phase by phase
  timeout "${PHASES_TIMEOUT:-300}" python3 scripts/runner_phases.py ${PHASES_ARGS:-} --out "$OUT" 2>&1 | tail -60
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" pdl "* ]]; then
  draw=0
  for pdl in ${PDL_ORDER:-0 1}; do
    draw=$((draw + 1))
    TORCHINDUCTOR_ENABLE_PDL=$pdl timeout -k 30 "${PDL_TIMEOUT:-200}" python3 -m compiled_attn.bench.decode_loop \
      --point "${PDL_POINT:-64x1024}" --backend FLASHINFER --side ours > "$OUT/pdl$pdl-$draw.log" 2>&1 || status=1
    echo "TORCHINDUCTOR_ENABLE_PDL=$pdl: $(grep -h "^{" "$OUT/pdl$pdl-$draw.log" | cut -c1-240)"
  done
  if [[ "${PDL_TESTS:-1}" == 1 ]]; then
    TORCHINDUCTOR_ENABLE_PDL=1 timeout -k 30 "${PDL_TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_graphs.py -k runner_compile 2>&1 | tee "$OUT/pdl-tests.log" | tail -5
    status=$(( status || PIPESTATUS[0] ))
  fi
fi
if [[ " $PARTS " == *" loop "* ]]; then
  for point in 64x1024 1x1024; do
    # LOOP_VARIANTS: ours' decode-loop variants (default both: positions passed, and fed back)
    timeout "${LOOP_TIMEOUT:-540}" python3 scripts/profile_decode.py --point "$point" \
      $(printf -- "--variant %s " ${LOOP_VARIANTS:-compile feedback}) \
      --out "$OUT/loop-$point" > "$OUT/loop-$point.log" 2>&1 || status=1
    grep -h "^\*\*" "$OUT/loop-$point.log"
  done
  timeout "${VARIANTS_TIMEOUT:-240}" python3 -m compiled_attn.bench.decode_flashinfer --variants 2>&1 | grep -v " - INFO - " \
    | tee "$OUT/decode-variants.log" | tail -40
  # the Triton decode's launch shapes (27 a point at 8 points, bf16 beside cuDNN's paged decode,
  # then e4m3 beside FlashInfer's fp8 decode; ~90 s each on an H200, most of it Triton's compiles)
  timeout "${SWEEP_TIMEOUT:-300}" python3 -m compiled_attn.bench.decode_flashinfer --triton-sweep 2>&1 \
    | grep -v " - INFO - " > "$OUT/triton-sweep.log"
  grep -E "^(cudnn|ours)" "$OUT/triton-sweep.log"
  # which Triton kernels a layer of ours and of the peer compiles to at batch 1 (~60 s)
  timeout "${KERNELS_TIMEOUT:-200}" python3 scripts/inductor_layer_kernels.py --batch 1 --out "$OUT" > /dev/null 2>&1 \
    || status=1
fi
if [[ " $PARTS " == *" grid "* ]]; then
  # The decode loop's grid points (GRID_POINTS, default one of the H200 points not measured on the
  # current tree: a point takes ~250 s, so one or two fit a device call) one side per process, so
  # that a slow peer cannot starve ours of the call: the peer the best of GRID_PEER_COMPILES (1)
  # compiles per SDPA choice, two choices (GRID_PEER_TIMEOUT: ~170 s on an H200), ours one (GRID_OURS_TIMEOUT: ~70 s a variant;
  # GRID_OURS_ARGS adds arguments, e.g. "--variant compile --variant fp8").
  # GRID_ORDER="ours peer" runs our side first: the side that runs second has run GEMMs 2-5 %
  # slower in both sessions' profiles (one process, the peer first), so the order is a suspect.
  # A side may come more than once ("peer ours ours peer": ABBA, each order once): each run logs
  # to grid-POINT-SIDE-N.log, N its place in GRID_ORDER (1-based).
  for point in ${GRID_POINTS:-64x4096}; do
    n=0
    for side in ${GRID_ORDER:-peer ours}; do
      n=$((n + 1))
      log="$OUT/grid-$point-$side-$n.log"
      case "$side" in
        peer) timeout -k 30 "${GRID_PEER_TIMEOUT:-240}" python3 -m compiled_attn.bench.decode_loop --point "$point" \
                --backend FLASHINFER --side peer --peer-compiles "${GRID_PEER_COMPILES:-1}" > "$log" 2>&1 || status=1 ;;
        ours) timeout -k 30 "${GRID_OURS_TIMEOUT:-150}" python3 -m compiled_attn.bench.decode_loop --point "$point" \
                --backend FLASHINFER --side ours --ours-compiles "${GRID_OURS_COMPILES:-1}" ${GRID_OURS_ARGS:-} \
                > "$log" 2>&1 || status=1 ;;
        *) echo "GRID_ORDER: unknown side '$side' (peer or ours)"; status=1; continue ;;
      esac
      grep -h "^{" "$log" | cut -c1-230 | sed "s/^/[$n: $side] /"
    done
  done
fi
if [[ " $PARTS " == *" autotune "* ]]; then
  timeout "${PROBE_TIMEOUT:-540}" python3 scripts/autotune_probe.py --suite "${PROBE_SUITE:-decode_loop}" --out "$OUT" \
    ${PROBE_ARGS:-} 2>&1 | tee "$OUT/autotune-probe.log" | tail -40
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" flex "* ]]; then  # the gate of a paged TORCH_SDPA decode through FlexAttention
  timeout "${FLEX_TIMEOUT:-420}" python3 scripts/flex_paged_probe.py --out "$OUT" ${FLEX_ARGS:-} 2>&1 | tee "$OUT/flex-probe.log" | tail -60
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" fuzz "* ]]; then
  FUZZ_REPORT="$OUT/fuzz-counts.jsonl" timeout "${FUZZ_TIMEOUT:-400}" python3 -m pytest -m gpu -q -p no:cacheprovider \
    "${xdist[@]}" tests/test_fuzz.py 2>&1 | tee "$OUT/gpu-fuzz.log" | tail -20
  status=$(( status || PIPESTATUS[0] ))
  python3 scripts/fuzz_counts.py "$OUT/fuzz-counts.jsonl" | tee "$OUT/fuzz-counts.txt"
fi
if [[ " $PARTS " == *" bench "* ]]; then
  start=$SECONDS  # the process's wall time: the suites' (printed per suite) plus imports and start-up
  timeout "${BENCH_TIMEOUT:-300}" python3 -m compiled_attn bench ${BENCH_ARGS:---quick} --out "$OUT" \
    2>&1 | tee "$OUT/bench.log" | tail -60
  status=$(( status || PIPESTATUS[0] ))
  echo "bench wall: $(( SECONDS - start )) s" | tee -a "$OUT/bench.log"
fi
if [[ " $PARTS " == *" piecewise "* ]]; then
  if [[ "${PW_TESTS:-1}" == 1 ]]; then
    timeout "${PW_TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_piecewise.py \
      2>&1 | tee "$OUT/piecewise-tests.log" | tail -20
    status=$(( status || PIPESTATUS[0] ))
  fi
  timeout "${PW_BENCH_TIMEOUT:-330}" python3 -m compiled_attn bench --suite piecewise_bench ${PW_BENCH_ARGS---quick} \
    --out "$OUT" 2>&1 | tee "$OUT/piecewise-bench.log" | grep -v " - INFO - " | tail -30
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" mixed "* ]]; then  # a mixed step as one FlashInfer prefill (the default on these models) vs split, same runner
  timeout "${MIXED_BENCH_TIMEOUT:-540}" python3 -m compiled_attn bench --suite piecewise_bench --quick \
    --backend FLASHINFER --out "$OUT" 2>&1 | tee "$OUT/mixed-bench.log" | grep -v " - INFO - " | tail -30
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" capture "* ]]; then  # issue 14's warm capture
  timeout "${CAPTURE_TIMEOUT:-560}" python3 -m compiled_attn.bench.piecewise_bench --capture-only \
    --backend "${CAPTURE_BACKEND:-FLASHINFER}" 2>&1 | tee "$OUT/capture.log" | grep -v " - INFO - " | tail -12
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" mixedhost "* ]]; then  # the same on the 16-layer model, host time and cProfile
  timeout "${MIXED_HOST_TIMEOUT:-400}" python3 scripts/profile_runner_host.py --backend FLASHINFER --steps 100 \
    --out "$OUT" 2>&1 | tee "$OUT/mixed-host.log" | grep "per step"
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" hf "* ]]; then
  timeout "${HF_TEST_TIMEOUT:-540}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=15 "${xdist[@]}" \
    tests/test_transformers.py ${HF_TEST_ARGS:-} 2>&1 | tee "$OUT/hf-tests.log" | tail -30
  status=$(( status || PIPESTATUS[0] ))
fi
if [[ " $PARTS " == *" hfbench "* ]]; then
  for part in ${HF_BENCH_PARTS:-b1}; do
    timeout "${HF_TIMEOUT:-540}" python3 -m compiled_attn.bench.hf_engine --part "$part" ${HF_ARGS:-} --out "$OUT" \
      2>&1 | grep -v " - INFO - " | tee "$OUT/hf-engine-$part.log" | tail -12
    status=$(( status || PIPESTATUS[0] ))
  done
fi
if [[ " $PARTS " == *" hunt "* ]]; then
  backend=${HUNT_BACKEND:-XFORMERS}
  timeout "${HUNT_TIMEOUT:-200}" python3 -u scripts/fault_hunt.py "$backend" 2>&1 | tee "$OUT/hunt.log" \
    | grep -E "FAULT|mismatch|no fault" | head -20
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [[ -f "$OUT/culprit.json" && -n "$sanitizer" ]]; then
    for case in culprit previous; do
      timeout 120 "$sanitizer" --print-limit 3 python3 scripts/fault_hunt.py "$backend" --replay "$OUT/$case.json" \
        > "$OUT/sanitizer-$case.log" 2>&1
      grep -m 6 -E "Invalid|ERROR SUMMARY|replay passed" "$OUT/sanitizer-$case.log"
    done
  fi
  if [[ -f "$OUT/culprit.json" ]] || grep -q "^mismatch" "$OUT/hunt.log"; then status=1; fi
fi
exit "$status"

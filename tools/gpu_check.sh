#!/usr/bin/env bash
# The GPU check before a kernel change lands: GPU tests, compute-sanitizer, benchmarks beside
# torch SDPA, the quantization step and the matrix units alone, cold-compile and cache-hit load
# times. Logs and JSON go to ${OUT:-gpu_check}.
#   tools/gpu_check.sh [tests] [sanitize] [bench] [kv8] [quant] [ceiling] [load]     (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 QATTN_CACHE_DIR=${QATTN_CACHE_DIR:-$out/cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps -e .
steps=${*:-tests sanitize bench kv8 quant ceiling load}
status=0
for step in $steps; do
  echo "=== $step"
  case $step in
    tests) python3 -m pytest -q -m gpu -x tests 2>&1 | tee "$out/tests.log" | tail -5 || status=1 ;;
    sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 python3 tools/sanitize.py 2>&1 | tee "$out/$tool.log" | tail -3 || status=1
      done ;;
    bench)
      # SageAttention joins as a peer when importable (e.g. wheels carried in .whl/ and on PYTHONPATH).
      python3 tools/bench_prefill.py --format f16 --format bf16 --format i8-f16 --format i8-i8 --format i8-f8 --format i8-f8@wgmma \
        --shape 4x32x4096 --shape 1x32x32768 --causal both --json "$out/bench_d128.json" || status=1
      python3 tools/bench_prefill.py --format f16 --format i8-f16 --format i8-i8 --format i8-f8 --format i8-f8@wgmma --head-dim 64 \
        --shape 4x32x8192 --json "$out/bench_d64.json" || status=1 ;;
    kv8)
      tools/parity --format kv8-imma,kv8-split,kv8-f32 --shape 32768/2048 --shape 1500/1500 --shape 2100/256 \
        --shape 32768/256 --shape 65536/64 --json "$out/parity_kv8.json" || status=1
      python3 tools/bench_kv8.py --shape 32768/2048 --shape 1500/1500 --shape 2100/256 --shape 32768/256 \
        --shape 65536/64 --json "$out/bench_kv8.json" || status=1 ;;
    quant)
      python3 tools/bench_quant.py --format i8-f8 --format i8-i8 --shape 4x32x4096 --shape 16x32x1024 \
        --shape 1x32x32768 2>&1 | tee "$out/quant.log" || status=1 ;;
    ceiling)
      { python3 tools/mma_ceiling.py && python3 tools/mma_ceiling.py --shared-operands; } 2>&1 | tee "$out/ceiling.log" || status=1 ;;
    load)
      # First process compiles (cold, empty cache); a second one must load without NVRTC.
      rm -rf "$QATTN_CACHE_DIR"
      for run in cold cached; do
        QATTN_NO_JIT=$([ $run = cached ] && echo 1 || echo 0) python3 -c "
import time, qattn
for fmt in ('f16', 'bf16', 'f32'):
    for d in (64, 128):
        t = time.perf_counter(); k = qattn.build('prefill', format=fmt, head_dim=d); k.function()
        print(f'$run {k.spec.name:44} {1e3 * (time.perf_counter() - t):8.1f} ms')
" || status=1
      done ;;
  esac
done
exit $status

#!/usr/bin/env bash
# The exact script run on the lent GPU for BENCHMARKS.md's quantize figures (issue 18): `orin-omni quantize` at the
# real model's widths on a random BF16 checkpoint with fewer thinker layers than the real 48, twice (N and 2N
# layers), so the time of one thinker layer and the fixed part (talker, vision encoder, calibration, metrics) can
# be told apart and the real model's time extrapolated. Each run's report.json (`run`: wall time per stage, the GPU
# and host peaks) and the command's --json go to $OUT.
#
# The GPU image has torch 2.11 and transformers 5.17: carry .whl/ with transformers 5.23, regex and PyAV (the
# built-in calibration set has a video), as for scripts/bench_gpu.sh. GPTQModel has no wheel for the image's
# Python (its pypcre dependency), so the run uses orin-omni's own solver.
# QBENCH_LAYERS: N (default 2); QBENCH_SIZES: the thinker layer counts to run (default "N 2N"; one device call
# may not hold both); QBENCH_ARGS: extra quantize options (e.g. --max-gpu-memory 22GiB). QBENCH_IN_MEMORY=1 also
# times the in-memory path (the whole BF16 model loaded, as quantize ran before it streamed) on the same
# checkpoint, with QBENCH_IN_MEMORY_ARGS (its --samples and --speech-samples: give the streamed run's);
# QBENCH_STREAMED=0 skips the streamed run (the in-memory one alone, when one device call cannot hold both).
# A conversation skipped for running out of memory fails the benchmark: the memory plan was wrong, and a run that
# skips conversations is not the run being measured (run 1 skipped every speech conversation, then died).
set -uo pipefail
OUT=${OUT:-build/qbench-out}
WORK=${QBENCH_WORKDIR:-/tmp/orin-qbench}
N=${QBENCH_LAYERS:-2}
mkdir -p "$OUT" "$WORK"
. scripts/device_site.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
rc=0
for layers in ${QBENCH_SIZES:-$N $((2 * N))}; do
  src="$WORK/bf16-$layers" dst="$WORK/int4-$layers"
  python3 -m orin.cli synthetic-bf16 "$src" --config tests/data/qwen3-omni-30b-a3b-instruct.config.json \
    --thinker-layers "$layers" --device cuda --force 2>&1 | tail -3 | tee -a "$OUT/quantize.log"
  if [ "${QBENCH_STREAMED:-1}" = 1 ]; then
    start=$(date +%s)
    python3 -m orin.cli quantize "$src" --out "$dst" --solver own --json ${QBENCH_ARGS:-} \
      > "$OUT/quantize-$layers.json" 2>> "$OUT/quantize.log" || rc=$?
    if [ "$rc" = 0 ] && grep -q "^warning: skipping calibration conversation .*OutOfMemoryError" "$OUT/quantize.log"; then
      echo "thinker layers $layers: conversations were skipped for running out of GPU memory" | tee -a "$OUT/quantize.log"
      rc=3
    fi
    echo "thinker layers $layers: quantize rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/quantize.log"
    cp "$dst/report.json" "$OUT/report-$layers.json" 2>/dev/null
  fi
  if [ "$rc" = 0 ] && [ "${QBENCH_IN_MEMORY:-0}" = 1 ]; then
    start=$(date +%s)
    python3 scripts/quantize_in_memory_bench.py "$src" ${QBENCH_IN_MEMORY_ARGS:-} > "$OUT/in-memory-$layers.json" \
      2>> "$OUT/quantize.log" || rc=$?
    echo "thinker layers $layers: in-memory path rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/quantize.log"
  fi
  rm -rf "$src" "$dst"
  [ "$rc" = 0 ] || break
done
tail -20 "$OUT/quantize.log"
exit "$rc"

#!/usr/bin/env bash
# The exact script run on the lent GPU for BENCHMARKS.md: `orin-omni bench` at the real model's dimensions
# (synthetic random INT4 checkpoint written to local disk, then orin-omni all-resident and time-sliced, then HF
# transformers BF16), in one command that ends inside the 10-minute window.
#
# The GPU image has torch 2.11 and transformers 5.17; orin-omni pins transformers 5.23 (module names differ), so
# its wheel travels in .whl/ (with regex, which 5.23 needs newer than the image may have, and PyAV, which the image
# lacks: the video cases time orin.inputs.video.load_video with it):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl transformers==5.23.0 regex==2026.11.15 av==18.1.0
# and the device call carries `.whl` (about 50 MB). Results go to $OUT (bench.json, bench.log, gpu.txt).
# BENCH_COMPILE: the all-resident engines' torch.compile settings, in order (runs orin_graph = off, orin_compiled =
# on; the last one also runs time-sliced).
# Arguments are passed on to `orin-omni bench` after the defaults (a repeated option replaces a default; a repeatable
# one adds to it). The video cases (issue 16) alone, on the first compile setting's engine and HF BF16:
#   bash scripts/bench_gpu.sh --video-seconds 120 --video-fps 2 --video-fps 1 --video-only
# (about 4.5 minutes on an H200), or beside the standard request (add --skip-sliced to stay inside the window):
#   bash scripts/bench_gpu.sh --video-seconds 120 --video-fps 2 --video-fps 1 --skip-sliced
set -uo pipefail
OUT=${OUT:-build/bench-out}
WORK=${BENCH_WORKDIR:-/tmp/orin-bench}
LIMIT=${BENCH_LIMIT_S:-540}
mkdir -p "$OUT" "$WORK"
. scripts/device_site.sh
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
  df -h "$WORK" | tail -1
  nproc; free -g | head -2
} 2>&1 | tee "$OUT/gpu.txt"
timeout -s INT "$LIMIT" python3 -m orin.cli bench \
  --config tests/data/qwen3-omni-30b-a3b-instruct.config.json --synthetic --workdir "$WORK" \
  --audio-seconds 30 --images 1 --text-tokens 256 --audio-frames 100 --budget-sliced 18GiB --budget-sliced 17GiB \
  --compile "${BENCH_COMPILE:-off,on}" --power-backend nvml --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/gpu.txt" 2>&1
rm -rf "$WORK"
exit "$rc"

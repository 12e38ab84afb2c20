#!/usr/bin/env bash
# Before/after benchmark driver for one lent-GPU call, run from the repo root (the BEFORE tree unpacked first:
# git archive REV | tar -x -C .base; the AFTER tree: the repo root, or AB_TREE_B=DIR):
#   bash scripts/ab/drive.sh std|sliced|rest|video|memory|probe
# Tree A = before = .base (git archive of 272f6af, no benchmarks/); tree B = after = the repo root. Both run
# `orin-omni bench` (python3 -m orin.cli bench, through scripts/ab/bench_shim.py: checksums checked by size only)
# on ONE synthetic INT4 checkpoint written once by scripts/ab/prep.py with tree A's code, with the options of
# scripts/bench_gpu.sh (standard request: 30 s audio + one 224² image + 256 text tokens + 100 speech frames, NVML
# energy) and --skip-hf --no-profile. Unlike bench_gpu.sh, nothing is deleted at the end: a next call on the same
# warm machine reuses the checkpoint and its packed copies (/tmp/orin-ab), and the installed wheels (/tmp/site).
#
# std    : per tree `--compile on,off --skip-sliced --realtime-question Q.wav`: the compiled engine fresh (standard
#          request, Realtime case on it), then the graph engine (standard request) in the same process.
# sliced : per tree `--compile on --budget-sliced 17,19,21,18,20 GiB` (the all-resident compiled engine first, as
#          bench always does, then the storage read, then one engine per budget, three requests each).
# video  : per tree `--compile off --skip-sliced --video-seconds 120 --video-fps 2 --video-fps 1`: the graph engine
#          fresh (standard request), then the 1 fps and 2 fps cases on it; with AB_PROBE=1, then the long-lived
#          probe if at least AB_PROBE_NEED_S (300) s are left.
# memory : tree B only, `--compile on --memory V --budget-sliced ...` per variant V of AB_MEMORY ("orin fallback"):
#          the weight arenas under the Orin profile's bounds, or every reservation refused (the loader's fallback).
# probe  : scripts/ab/probe_longlived.py alone (defect 2), on tree A (or AB_PROBE_TREE=B).
#
# Results in $OUT: log.txt (everything), NAME-A.json / NAME-B.json (bench --json), summary.txt (before/after
# tables), probe.json (probe). Each step runs under `timeout` from what is left of AB_LIMIT_S (default 540 s);
# a step that would get under 40 s is skipped and said so. Env: AB_WORK (/tmp/orin-ab), AB_CONFIG, AB_DEVICE
# (auto), AB_POWER (nvml), AB_LIMIT_S, AB_ORDER (AB or BA: which tree runs first; default per mode), AB_BUDGETS
# ("17 19 21 18 20", GiB, in this order), AB_VIDEO_FPS ("2 1"; the bench runs the lower rate first), AB_PROBE=1.
set -uo pipefail
MODE=${1:?usage: drive.sh std|sliced|rest|video|memory|probe}
ROOT=$PWD
T0=$(date +%s)
LIMIT=${AB_LIMIT_S:-540}
OUT=${OUT:-$ROOT/build/ab-out}
W=${AB_WORK:-/tmp/orin-ab}
CK=$W/ckpt
CONFIG=${AB_CONFIG:-tests/data/qwen3-omni-30b-a3b-instruct.config.json}
DEV=${AB_DEVICE:-auto}
POWER=${AB_POWER:-nvml}
PLAN=${AB_PLAN:-$(cd "$(dirname "$0")" && pwd)}  # this folder: the driver's helpers and Q.wav
TREE_A=$ROOT/.base
TREE_B=${AB_TREE_B:-$ROOT}
mkdir -p "$OUT" "$W"

el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( LIMIT - $(el) )); }
say() { echo "=== [+$(el)s] $*"; }

# sha of what the packed copies' key holds (orin.packed_cache: FORMAT and the converters' source): equal keys
# share one packed cache, else tree B gets its own (or repacks the shared one when the disk has no room)
packkey() {
  (cd "$1" && for f in int4pack.py int4_experts.py int4.py gptq_format.py layout.py; do
     cat "orin/$f" 2>/dev/null || echo "missing $f"; done
   grep -hE '^(FORMAT|_CONVERTERS) *=' orin/packed_cache.py 2>/dev/null || echo "no packed_cache.py") | sha256sum | cut -c1-16
}
owner_file() { echo "$W/owner-$(echo "$1" | sha256sum | cut -c1-12)"; }

tree_dir() { [ "$1" = A ] && echo "$TREE_A" || echo "$TREE_B"; }
pack_dir() { [ "$1" = A ] && echo "$PA" || echo "$PB"; }
pack_key() { [ "$1" = A ] && echo "$KA" || echo "$KB"; }

# run_py TREE TIMEOUT_S SCRIPT ARGS...: python3 in the tree's root, its orin first on the path
run_py() {
  local t=$1 to=$2 dir; shift 2
  dir=$(tree_dir "$t")
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout -k 10 -s INT "$to" python3 "$@")
}

ensure_ckpt() {
  if [ -f "$CK/.ab-ready" ]; then say "checkpoint reused: $CK ($(du -sh "$CK" 2>/dev/null | cut -f1))"; return 0; fi
  say "prep: synthetic checkpoint + packed copies with tree A (about 100-120 s)"
  rm -rf "$CK" "$W"/owner-*
  local s; s=$(date +%s)
  run_py A "$(( $(left) - 60 ))" "$PLAN/prep.py" "$CK" --config "$CONFIG" --device "$DEV" --packed-cache "$PA"
  local rc=$?
  say "prep rc=$rc in $(( $(date +%s) - s ))s"
  [ $rc = 0 ] || return 1
  echo "$KA" > "$(owner_file "$PA")"
  touch "$CK/.ab-ready"
}

# the tree's packed copies in its cache directory before it is measured (a no-op when they are there)
ensure_pack() {
  local t=$1 dir key s rc
  dir=$(pack_dir "$t"); key=$(pack_key "$t")
  [ "$(cat "$(owner_file "$dir")" 2>/dev/null)" = "$key" ] && return 0
  say "packing for tree $t into $dir (its converter code differs from the other tree's)"
  s=$(date +%s)
  if [ "$t" = A ]; then
    run_py A 240 "$PLAN/prep.py" "$CK" --config "$CONFIG" --device "$DEV" --pack-only --packed-cache "$dir"
  else  # the after tree's own loader, through its CLI only (its internals may differ)
    run_py B 240 "$PLAN/bench_shim.py" bench --model-dir "$CK" --packed-cache "$dir" --device "$DEV" --compile off \
      --skip-hf --skip-sliced --no-profile --text-tokens 2 --audio-frames 0 --audio-seconds 1 --images 1 \
      --power-backend none --json "$W/pack-B.json" > "$W/pack-B.log" 2>&1
  fi
  rc=$?
  sync
  say "pack for $t rc=$rc in $(( $(date +%s) - s ))s"
  [ $rc = 0 ] && echo "$key" > "$(owner_file "$dir")"
  return $rc
}

# bench NAME TREE MAX_S ARGS...: one `orin-omni bench` process of the tree; its JSON is $OUT/NAME-TREE.json
bench() {
  local name=$1 t=$2 max=$3 s rc to l; shift 3
  ensure_pack "$t" || say "WARNING: tree $t measured without valid packed copies (its first load converts)"
  l=$(left); to=$(( max < l ? max : l ))
  if (( to < 40 )); then say "SKIP $name-$t: $l s left"; return 0; fi
  say "$name-$t: tree $t ($( [ "$t" = A ] && echo 'BEFORE, .base = 272f6af' || echo 'AFTER, repo root')), timeout ${to}s"
  s=$(date +%s)
  run_py "$t" "$to" "$PLAN/bench_shim.py" bench --model-dir "$CK" --packed-cache "$(pack_dir "$t")" --device "$DEV" \
    --audio-seconds 30 --images 1 --text-tokens 256 --audio-frames 100 --power-backend "$POWER" --skip-hf \
    --no-profile --json "$OUT/$name-$t.json" "$@"
  rc=$?
  say "$name-$t rc=$rc in $(( $(date +%s) - s ))s"
}

# the trees' order: AB_ORDER if set; with one shared packed cache and differing keys, the tree whose copies are
# there first (one repack per command, not two); else the mode's default
order_for() {
  if [ -n "${AB_ORDER:-}" ]; then echo "$AB_ORDER"; return; fi
  if [ "$KA" != "$KB" ] && [ "$PA" = "$PB" ]; then
    [ "$(cat "$(owner_file "$PA")" 2>/dev/null)" = "$KB" ] && echo BA || echo AB
    return
  fi
  echo "$1"
}

gpu_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu --format=csv 2>&1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)" 2>&1
  df -h "$W" | tail -1; nproc; free -g | head -2
  echo "packed keys: A $KA, B $KB -> B's cache $PB"
}

main() {
  say "drive.sh $MODE: limit ${LIMIT}s, work $W, out $OUT"
  if [ -z "${AB_SKIP_SITE:-}" ]; then . "$PLAN/site.sh" || return 1; fi
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  KA=$(packkey "$TREE_A"); KB=$(packkey "$TREE_B")
  PA=$CK/packed-cache
  if [ "$KA" = "$KB" ]; then PB=$PA
  else
    # a second cache needs ~21.5 GB beside the checkpoint and the first (plus the cache's own 2 GiB margin): on
    # the work disk if it has room, else in /dev/shm (RAM; the swap-ins read the page cache either way), else
    # one shared cache, repacked when the tree changes (about 60-80 s each time)
    local need=$(( 26 * 1024 * 1024 * 1024 )) avail shm
    avail=$(df -B1 --output=avail "$W" | tail -1); shm=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1)
    if [ -d "$W/packed-B" ] || [ "${avail:-0}" -gt "$need" ]; then PB=$W/packed-B
    elif [ -d /dev/shm/orin-ab-packed-B ] || [ "${shm:-0}" -gt "$need" ]; then PB=/dev/shm/orin-ab-packed-B
    else PB=$PA; fi
  fi
  gpu_info
  ensure_ckpt || { say "no checkpoint: stopping"; return 1; }
  case $MODE in
    std)
      for t in $(order_for AB | fold -w1); do
        bench std "$t" 250 --compile "${AB_STD_COMPILE:-on,off}" --skip-sliced --realtime-question "$PLAN/Q.wav"
      done ;;
    sliced)
      local budgets=()
      for b in ${AB_BUDGETS:-17 19 21 18 20}; do budgets+=(--budget-sliced "${b}GiB"); done
      for t in $(order_for BA | fold -w1); do
        bench sliced "$t" 270 --compile on "${budgets[@]}"
      done ;;
    rest)  # sliced, then video, in one call (AB_BUDGETS, AB_VIDEO_FPS as below)
      local budgets=() rates=()
      for b in ${AB_BUDGETS:-17 19 21}; do budgets+=(--budget-sliced "${b}GiB"); done
      for f in ${AB_VIDEO_FPS:-2}; do rates+=(--video-fps "$f"); done
      for t in $(order_for BA | fold -w1); do
        bench sliced "$t" 200 --compile on "${budgets[@]}"
      done
      for t in $(order_for AB | fold -w1); do
        bench video "$t" 150 --compile off --skip-sliced --video-seconds 120 "${rates[@]}"
      done ;;
    video)
      local rates=()
      for f in ${AB_VIDEO_FPS:-2 1}; do rates+=(--video-fps "$f"); done
      for t in $(order_for AB | fold -w1); do
        bench video "$t" 200 --compile off --skip-sliced --video-seconds 120 "${rates[@]}"
      done
      if [ -n "${AB_PROBE:-}" ] && (( $(left) >= ${AB_PROBE_NEED_S:-300} )); then
        say "time left for the long-lived probe: $(left)s"
        run_py "${AB_PROBE_TREE:-A}" "$(( $(left) - 10 ))" "$PLAN/probe_longlived.py" --model-dir "$CK" \
          --packed-cache "$(pack_dir "${AB_PROBE_TREE:-A}")" --config "$CONFIG" --device "$DEV" \
          --power-backend "$POWER" --json "$OUT/probe.json"
        say "probe rc=$?"
      else
        say "probe not run (AB_PROBE=${AB_PROBE:-unset}, $(left)s left, needs ${AB_PROBE_NEED_S:-300})"
      fi ;;
    memory)  # tree B only: each of AB_MEMORY's variants (orin, fallback) time-sliced at AB_BUDGETS
      local budgets=()
      for b in ${AB_BUDGETS:-17 19 21}; do budgets+=(--budget-sliced "${b}GiB"); done
      for v in ${AB_MEMORY:-orin fallback}; do
        bench "mem-$v" B 220 --compile on --memory "$v" "${budgets[@]}"
      done ;;
    probe)
      ensure_pack "${AB_PROBE_TREE:-A}"
      run_py "${AB_PROBE_TREE:-A}" "$(( $(left) - 10 ))" "$PLAN/probe_longlived.py" --model-dir "$CK" \
        --packed-cache "$(pack_dir "${AB_PROBE_TREE:-A}")" --config "$CONFIG" --device "$DEV" \
        --power-backend "$POWER" --json "$OUT/probe.json"
      say "probe rc=$?" ;;
    *) echo "unknown mode $MODE"; return 2 ;;
  esac
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>&1
  if ls "$OUT"/*-[AB].json > /dev/null 2>&1; then
    python3 "$PLAN/summarize.py" "$OUT" > "$OUT/summary.txt" 2>&1
    cat "$OUT/summary.txt"
  fi
  say "done"
}

main 2>&1 | tee -a "$OUT/log.txt"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# gpu_wave.sh stages in parallel lanes, each on its own GPUs of a multi-GPU machine; each
# lane's output goes to $OUT/lane<i>.log and is printed when every lane has finished. Usage:
#   bash scripts/gpu_lanes.sh "0,1:tp2" "2:mixed prefix" "3:fused"
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
lanes=("$@")
for i in "${!lanes[@]}"; do
  lane=${lanes[$i]}
  CUDA_VISIBLE_DEVICES=${lane%%:*} OUT=$OUT bash scripts/gpu_wave.sh ${lane#*:} > "$OUT/lane$i.log" 2>&1 &
done
wait
for i in "${!lanes[@]}"; do echo "##### lane $i: ${lanes[$i]}"; tail -40 "$OUT/lane$i.log"; done

#!/usr/bin/env bash
# Lab (GPU, Firecracker runtime): Nsight Compute's view of the Gluon W4A16 kernel (stall reasons, issue
# slots, occupancy, memory throughput) at the shapes given as "M K N" arguments (default: M = 64 on
# the 7B fused gate/up matrix). Run from the repository root (session 12's run, docs/benchmarks.md):
#   bash experiments/lab/gluon/ncu_gluon.sh "64 3584 37888" "128 3584 37888" "128 18944 3584"
# It writes $OUT/ncu_g_*. (At M = 8 the profiled process crashed with a segmentation fault, session 12.)
# NCU_SOURCE=0 leaves out the SourceCounters section (session 26: a first suspect for that crash).
set -uo pipefail
OUT=${OUT:-/tmp/ncu}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
for shape in "${@:-64 3584 37888}"; do
  tag=$(echo "$shape" | tr ' ' '_')
  timeout 150 ncu --clock-control none --target-processes all -k regex:w4a16_gemv --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    $( [[ "${NCU_SOURCE:-1}" == 1 ]] && echo --section SourceCounters ) -f -o "$OUT/ncu_g_$tag" python3 experiments/lab/gluon/ncu_target.py $shape > "$OUT/ncu_g_$tag.log" 2>&1
  ncu -i "$OUT/ncu_g_$tag.ncu-rep" --page details > "$OUT/ncu_g_$tag.txt" 2>&1
  ncu -i "$OUT/ncu_g_$tag.ncu-rep" --page raw --csv > "$OUT/ncu_g_${tag}_raw.csv" 2>&1
  echo "== M K N = $shape"; tail -1 "$OUT/ncu_g_$tag.log"
  grep -i "stall\|duration\|dram throughput\|memory throughput\|L2 cache throughput\|achieved occupancy\|registers per\|issue slots busy\|warp cycles per issued\|eligible warps\|active warps\|theoretical occ\|block limit" "$OUT/ncu_g_$tag.txt" | head -30
done

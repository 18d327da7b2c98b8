#!/usr/bin/env bash
# Lab (GPU): Nsight Compute's view of the tuned small-M forward kernel (warp stall reasons, issue
# slots, occupancy, memory throughput), to test the session-6 reading that it waits on dependency
# chains rather than on bandwidth or issue (docs/benchmarks.md, session 6). Needs the Firecracker
# runtime (hardware counters; see the device tool's H200.md). Run from the repository root:
#   bash experiments/lab/ncu_small_m.sh            # writes $OUT/ncu_*.txt
set -uo pipefail
OUT=${OUT:-/tmp/ncu}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}
for shape in "8 3584 37888" "8 18944 3584" "32 3584 37888" "64 3584 37888"; do
  tag=$(echo "$shape" | tr ' ' '_')
  timeout 150 ncu --clock-control none --target-processes all -k regex:w4a16_fwd --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    -f -o "$OUT/ncu_$tag" python3 experiments/lab/ncu_target.py $shape > "$OUT/ncu_$tag.log" 2>&1
  ncu -i "$OUT/ncu_$tag.ncu-rep" --page details > "$OUT/ncu_$tag.txt" 2>&1
  echo "== M K N = $shape"; grep -i "duration\|throughput\|achieved occupancy\|registers per\|issue slots\|stall\|eligible\|active warps" "$OUT/ncu_$tag.txt" | head -40
done

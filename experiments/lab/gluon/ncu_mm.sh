#!/usr/bin/env bash
# Lab (GPU): Nsight Compute's view of the large-M Gluon forward (w4a16_mm) at "M K N" arguments (default the 7B
# fused gate/up at M = 2048): speed of light, stall reasons (with source lines), issue slots, memory. Writes
# $OUT/ncu_mm_*; prints the headline metrics. Run from the repository root with PYTHONPATH set.
set -uo pipefail
OUT=${OUT:-/tmp/ncu}
mkdir -p "$OUT"
for shape in "${@:-2048 3584 37888}"; do
  tag=$(echo "$shape" | tr ' ' '_')
  timeout 200 ncu --clock-control none -k regex:w4a16_mm --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    $( [[ "${NCU_SOURCE:-1}" == 1 ]] && echo --section SourceCounters ) -f -o "$OUT/ncu_mm_$tag" \
    python3 experiments/lab/gluon/ncu_mm.py $shape > "$OUT/ncu_mm_$tag.log" 2>&1
  ncu -i "$OUT/ncu_mm_$tag.ncu-rep" --page details > "$OUT/ncu_mm_$tag.txt" 2>&1
  ncu -i "$OUT/ncu_mm_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_mm_${tag}_sass.csv" 2>&1
  echo "== M K N = $shape"; tail -2 "$OUT/ncu_mm_$tag.log"
  grep -i "duration\|throughput\|pipe\|stall\|issue slots\|warp cycles per issued\|eligible\|active warps\|registers\|tensor\|shared" "$OUT/ncu_mm_$tag.txt" | head -60
done

"""Lab (GPU host with Nsight Compute): the warp stall reasons of an ncu report's raw CSV page, largest first.

  ncu -i report.ncu-rep --page raw --csv > raw.csv; python3 experiments/lab/gluon/ncu_stalls.py raw.csv
Prints each ``smsp__average_warp_latency_issue_stalled_*`` / ``..._warps_issue_stalled_*_per_issue_active``
ratio (cycles a warp spends stalled for that reason per issued instruction), and a few headline metrics."""
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if "Kernel Name" in r or "ID" in r[:2]), None)
if head is None or len(rows) < head + 3:
  sys.exit(f"{sys.argv[1]}: no profiled kernel in this CSV (did the profiled process fail?)")
names, values = rows[head], rows[head + 2]
stalls = []
for name, value in zip(names, values):
  if "issue_stalled" in name and name.endswith("per_issue_active.ratio"):
    try:
      stalls.append((float(value.replace(",", "")), name))
    except ValueError:
      pass
for value, name in sorted(stalls, reverse=True)[:14]:
  print(f"{value:8.2f}  {name}")
for key in ("gpu__time_duration.sum", "sm__warps_active.avg.pct_of_peak_sustained_active",
            "smsp__issue_active.avg.pct_of_peak_sustained_active", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
            "launch__registers_per_thread", "launch__occupancy_limit_registers"):
  if key in names:
    print(f"{key} = {values[names.index(key)]}")

"""Lab: fused-kernel tile sweep at M = 8, 32, 64 on the 7B shapes by device time (GPU only).

Session 3's offline SASS counts (experiments/lab/offline_sass.py) put the tuned M <= 16 config at
161 registers a thread (3 blocks of 4 warps an SM), so this sweeps tiles that need fewer registers
(block_n 64, block_k 64, 8 warps) and more programs, with and without the register prefetch. Each
config is checked against the XLA reference (NaN-poisoned output), then timed as the summed kernel
device time per call (fused kernel + split-K sum) over rotating weight copies.

  PYTHONPATH=$PWD python3 experiments/lab/sweep_small_m.py
"""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from labcommon import SHAPES_7B, activations, checked_error, rotating_weights, us_per_call
from pallas_kernels import w4_triton

VARIANTS = {  # block_n, block_k, warps, stages, target programs, prefetch
    "tuned": (128, 128, 4, 3, 528, True),
    "n64": (64, 128, 4, 3, 528, True),
    "n64_t1k": (64, 128, 4, 3, 1056, True),
    "n64_nopf": (64, 128, 4, 3, 528, False),
    "w8": (128, 128, 8, 3, 528, True),
    "k64_nopf_t1k": (128, 64, 4, 3, 1056, False),
    "k64_t1k": (128, 64, 4, 3, 1056, True),
    "nopf": (128, 128, 4, 3, 528, False),
    "n64_k256": (64, 256, 4, 3, 528, True),
}
T0 = time.time()
totals = {}
for name, (k, n) in SHAPES_7B.items():
  q0, qs = rotating_weights(k, n)
  for m in (8, 32, 64):
    x = activations(m, k)
    line = []
    for tag, (bn, bk, warps, stages, target, pf) in VARIANTS.items():
      bm = max(16, m)
      tiles = -(-n // bn) * -(-m // bm)
      splits = max(1, min(k // bk // 2, -(-target // tiles), 32))
      cfg = w4_triton.TileConfig(block_m=bm, block_n=bn, block_k=bk, splits=splits, num_warps=warps,
                                 num_stages=stages, split_x="registers", decode="asm", prefetch=pf)
      try:
        fwd = lambda x, w, cfg=cfg, **kw: w4_triton.forward(x, w, config=cfg, **kw)
        checked_error(fwd, x, q0)
        us = us_per_call(fwd, x, qs)
        totals[(m, tag)] = totals.get((m, tag), 0.0) + us
        line.append(f"{tag} {us:5.1f}")
      except Exception as e:
        totals[(m, tag)] = float("inf")
        line.append(f"{tag} FAIL {repr(e)[:60]}")
    print(f"{name:8s} M={m:2d}: " + " | ".join(line), flush=True)
for m in (8, 32, 64):
  row = sorted((v, t) for (mm, t), v in totals.items() if mm == m)
  print(f"M={m} summed us, best first: " + ", ".join(f"{t} {v:.1f}" for v, t in row), flush=True)
print(f"elapsed {time.time() - T0:.0f}s")

"""Lab: fused-kernel tile sweep at M = 8, 32, 64 on the 7B shapes by device time (GPU only).

Session 3's offline SASS counts (experiments/lab/offline_sass.py) put the tuned M <= 16 config at
161 registers a thread (3 blocks of 4 warps an SM), so this sweeps tiles that need fewer registers
(block_n 64, block_k 64, 8 warps) and more programs, with and without the register prefetch. Each
config is checked against the XLA reference (NaN-poisoned output), then timed as the summed kernel
device time per call (fused kernel + split-K sum) over rotating weight copies.

  PYTHONPATH=$PWD python3 experiments/lab/sweep_small_m.py
"""
import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax, jax.numpy as jnp, numpy as np
import devtime
from pallas_kernels import w4_triton
from pallas_kernels.matmul import reference_matmul
from qerl_jax import nvfp4

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
SHAPES = {"7b_qkv": (3584, 4608), "7b_o": (3584, 3584), "7b_gate": (3584, 18944), "7b_down": (18944, 3584)}
T0 = time.time()
totals = {}
for name, (k, n) in SHAPES.items():
  q0 = nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02)
  r = max(2, -(-(256 << 20) // (k * n // 2)))
  qs = [jax.tree.map(lambda a, i=i: a ^ jnp.uint8(i % 2) if a.dtype == jnp.uint8 else a, q0) for i in range(r)]
  for m in (8, 32, 64):
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    ref = reference_matmul(x, q0, out_dtype=jnp.float32)
    line = []
    for tag, (bn, bk, warps, stages, target, pf) in VARIANTS.items():
      bm = max(16, m)
      tiles = -(-n // bn) * -(-m // bm)
      splits = max(1, min(k // bk // 2, -(-target // tiles), 32))
      cfg = w4_triton.TileConfig(block_m=bm, block_n=bn, block_k=bk, splits=splits, num_warps=warps,
                                 num_stages=stages, split_x="registers", decode="asm", prefetch=pf)
      try:
        y = w4_triton.forward(x, q0, config=cfg, out_dtype=jnp.float32, poison_output=True)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        assert err < 1e-2 and not bool(jnp.isnan(y).any()), err
        f = jax.jit(lambda x, qs, cfg=cfg: [w4_triton.forward(x, q, config=cfg) for q in qs])
        durs = devtime.trace_durations(f, x, qs)
        us = float(sum(sum(v) for v in durs.values())) / len(qs)
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

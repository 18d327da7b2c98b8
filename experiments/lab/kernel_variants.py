"""Lab: fused-kernel tile variants by device time, then a batch-8 rollout with the M=8 winner (GPU only).

Variants of the tuned config (prefetch, 8 warps, block_k 128 with twice the splits, twice the
splits) at 7B shapes and M = 1, 8, 32; each checked against the XLA reference on a NaN-poisoned
output first; device time = median over a jax.profiler trace of 8+ calls on rotating copies.

  PYTHONPATH=$PWD python3 experiments/lab/kernel_variants.py
"""
import dataclasses, json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp, numpy as np
import devtime
from labcommon import SHAPES_7B as SHAPES, activations, checked_error, rotating_weights
from pallas_kernels import w4_triton
OUT = os.environ.get("OUT", "/tmp")
T0 = time.time()

def device_us(fn, args, d=None):
  """Median device time (µs) of the fused forward kernels in one traced call."""
  durs = devtime.trace_durations(fn, *args)
  return float(np.median([t for name, ts in durs.items() if name.startswith("w4a16_fwd") for t in ts]))

def variants(base):
  r = dataclasses.replace
  return {"tuned": base, "prefetch": r(base, prefetch=True), "pf_w8": r(base, prefetch=True, num_warps=8),
          "pf_bk128": r(base, prefetch=True, block_k=128, splits=min(32, base.splits * 2)),
          "pf_split2x": r(base, prefetch=True, splits=min(32, base.splits * 2))}

totals = {}
for name, (k, n) in SHAPES.items():
  q0, qs = rotating_weights(k, n)
  for m in (1, 8, 32):
    x = activations(m, k)
    line = []
    for vname, cfg in variants(w4_triton.default_config(m, k, n)).items():
      try:
        checked_error(lambda x, w, cfg=cfg, **kw: w4_triton.forward(x, w, config=cfg, **kw), x, q0)
        us = device_us(jax.jit(lambda x, qs, cfg=cfg: [w4_triton.forward(x, q, config=cfg) for q in qs]), (x, qs),
                       os.path.join(OUT, "t"))
        totals.setdefault(m, {}).setdefault(vname, 0.0); totals[m][vname] += us
        line.append(f"{vname} {us:5.1f}us {(k*n*9/16)/us/1e3:5.0f}GB/s")
      except Exception as e:
        totals.setdefault(m, {})[vname] = float("inf"); line.append(f"{vname} FAIL {repr(e)[:100]}")
    print(f"{name:8s} M={m:2d} s{w4_triton.default_config(m, k, n).splits:2d}: " + " | ".join(line), flush=True)
print("totals", json.dumps(totals), f"elapsed {time.time()-T0:.0f}s", flush=True)

# rollout at batch 8 with each M<=16 bucket's winner (by summed time) patched into the tuned table
from absl import flags; flags.FLAGS(["x"])
import bench_rollout as br
from qerl_jax import models
best8 = min(totals[8], key=totals[8].get)
print("winner at M=8:", best8)
if best8 != "tuned" and time.time() - T0 < 200:
  v = variants(w4_triton.default_config(8, 3584, 18944))[best8]
  row = list(w4_triton.TUNED[("fwd", 16)])
  row[0:5] = [16, v.block_n, v.block_k, v.num_warps, v.num_stages]
  if best8 in ("pf_bk128", "pf_split2x"): row[5] *= 2
  w4_triton.TUNED[("fwd", 16)] = tuple(row[:8]) + (True,)
  print("patched", w4_triton.TUNED[("fwd", 16)])
  cfg = models.ModelConfig.from_hf(br.QWEN25_7B)
  base = br.make_base(cfg, "nvfp4")
  res = br.bench_one(cfg, base, 8, 256, 1024, 2.95e12)
  print(f"ROLLOUT nvfp4 batch 8 1024 tok: {res['tokens_per_s']:.0f} tok/s, step {res['step_ms']:.2f} ms")

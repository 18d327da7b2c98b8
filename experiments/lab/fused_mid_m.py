"""Lab: fused kernel vs dequantize + cuBLAS vs bf16 at M = 64..256 (GPU only), device time.

The kernel path sends M > FUSED_MAX_M (32) to a Pallas dequantize + jnp.dot. This times, at 7B shapes,
fused-kernel configs with the inline-PTX decode against that path and a bf16 jnp.dot, each checked
against the XLA reference first (NaN-poisoned output).

  PYTHONPATH=$PWD python3 experiments/lab/fused_mid_m.py
"""
import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax, jax.numpy as jnp, numpy as np
import devtime
from pallas_kernels import w4_triton
from pallas_kernels.matmul import reference_matmul
from qerl_jax import nvfp4
import dataclasses


def cfg_for(m, k, n, bm, bn, bk, warps, stages, programs, prefetch):
  """A TileConfig whose split-K gives about ``programs`` programs for this shape."""
  tiles = -(-n // bn) * -(-m // bm)
  splits = max(1, min(k // bk, round(programs / tiles)))
  return w4_triton.TileConfig(block_m=bm, block_n=bn, block_k=bk, splits=splits, num_warps=warps,
                              num_stages=stages, split_x="registers", decode="asm", prefetch=prefetch)


CONFIGS = {  # (block_m, block_n, block_k, warps, stages, target programs, prefetch)
    "f64_pf": (64, 128, 128, 4, 3, 528, True),
    "f64": (64, 128, 128, 4, 3, 264, False),
    "f64_n64_pf": (64, 64, 128, 4, 3, 528, True),
    "f128_w8": (128, 128, 128, 8, 3, 264, False),
}
SHAPES = {"7b_qkv": (3584, 4608), "7b_o": (3584, 3584), "7b_gate": (3584, 18944), "7b_down": (18944, 3584)}
T0 = time.time()

totals = {}
for name, (k, n) in SHAPES.items():
  q0 = nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02)
  r = max(2, -(-(256 << 20) // (k * n // 2)))
  qs = [jax.tree.map(lambda a, i=i: a ^ jnp.uint8(i % 2) if a.dtype == jnp.uint8 else a, q0) for i in range(r)]
  ws = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) for i in range(max(2, -(-(256 << 20) // (k * n * 2))))]
  for m in (64, 128, 256):
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    ref = reference_matmul(x, q0, out_dtype=jnp.float32)
    line = []
    # dequantize + cuBLAS (the current kernel path for M > 32): all kernels of the call
    f = jax.jit(lambda x, qs: [jnp.dot(x, w4_triton.dequantize(q, jnp.bfloat16), preferred_element_type=jnp.float32).astype(jnp.bfloat16) for q in qs])
    durs = devtime.trace_durations(f, x, qs)
    deq = float(sum(sum(v) for v in durs.values())) / len(qs)
    fb = jax.jit(lambda x, ws: [jnp.dot(x, w) for w in ws])
    durs = devtime.trace_durations(fb, x, ws)
    bf = float(sum(sum(v) for v in durs.values())) / len(ws)
    line.append(f"bf16 {bf:6.1f} | deq+dot {deq:6.1f}")
    for tag, spec in CONFIGS.items():
      if spec[0] > m:
        continue
      cfg = cfg_for(m, k, n, *spec)
      try:
        y = w4_triton.forward(x, q0, config=cfg, out_dtype=jnp.float32, poison_output=True)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        assert err < 1e-2 and not bool(jnp.isnan(y).any()), err
        f = jax.jit(lambda x, qs, cfg=cfg: [w4_triton.forward(x, q, config=cfg) for q in qs])
        durs = devtime.trace_durations(f, x, qs)
        us = float(sum(sum(v) for v in durs.values())) / len(qs)  # kernel + split-K sum
        line.append(f"{tag} {us:6.1f}")
        totals.setdefault((m, tag), 0.0); totals[(m, tag)] += us
      except Exception as e:
        line.append(f"{tag} FAIL {repr(e)[:80]}")
    totals.setdefault((m, "deq"), 0.0); totals[(m, "deq")] += deq
    totals.setdefault((m, "bf16"), 0.0); totals[(m, "bf16")] += bf
    print(f"{name:8s} M={m:3d} us: " + " | ".join(line), flush=True)
print({f"{m}:{t}": round(v, 1) for (m, t), v in sorted(totals.items())}, f"elapsed {time.time() - T0:.0f}s", flush=True)

# Wave quantization probe at M = 8: the tuned config with other split-K counts.
for name, (k, n) in SHAPES.items():
  q0 = nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02)
  r = max(2, -(-(256 << 20) // (k * n // 2)))
  qs = [jax.tree.map(lambda a, i=i: a ^ jnp.uint8(i % 2) if a.dtype == jnp.uint8 else a, q0) for i in range(r)]
  x = jax.random.normal(jax.random.key(8), (8, k), jnp.float32).astype(jnp.bfloat16)
  base = w4_triton.default_config(8, k, n)
  line = []
  for splits in (1, 2, 3, 4, 6, 8, 12):
    if splits > k // base.block_k:
      continue
    cfg = dataclasses.replace(base, splits=splits)
    f = jax.jit(lambda x, qs, cfg=cfg: [w4_triton.forward(x, q, config=cfg) for q in qs])
    durs = devtime.trace_durations(f, x, qs)
    us = float(sum(sum(v) for v in durs.values())) / len(qs)
    line.append(f"s{splits} {us:5.1f}")
  print(f"{name:8s} M=8 tuned splits={base.splits} (sum of kernels per call, us): " + " | ".join(line), flush=True)

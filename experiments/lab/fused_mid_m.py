"""Lab: fused kernel vs dequantize + cuBLAS vs bf16 at M = 64..256 (GPU only), device time.

Before d135f8b the kernel path sent M > 32 to a Pallas dequantize + jnp.dot. This times, at 7B shapes,
fused-kernel configs with the inline-PTX decode against that path and a bf16 jnp.dot, each checked
against the XLA reference first (NaN-poisoned output).

  PYTHONPATH=$PWD python3 experiments/lab/fused_mid_m.py
"""
import dataclasses, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp
from labcommon import SHAPES_7B as SHAPES, activations, checked_error, rotating_weights, us_per_call
from pallas_kernels import w4_triton


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
T0 = time.time()

totals = {}
def deq_dot(x, q):
  return jnp.dot(x, w4_triton.dequantize(q, jnp.bfloat16), preferred_element_type=jnp.float32).astype(jnp.bfloat16)


for name, (k, n) in SHAPES.items():
  q0, qs = rotating_weights(k, n)
  ws = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) for i in range(max(2, -(-(256 << 20) // (k * n * 2))))]
  for m in (64, 128, 256):
    x = activations(m, k)
    line = []
    deq = us_per_call(deq_dot, x, qs)  # dequantize + cuBLAS (the kernel path for M > 32 before d135f8b)
    bf = us_per_call(jnp.dot, x, ws)
    line.append(f"bf16 {bf:6.1f} | deq+dot {deq:6.1f}")
    for tag, spec in CONFIGS.items():
      if spec[0] > m:
        continue
      cfg = cfg_for(m, k, n, *spec)
      try:
        fwd = lambda x, w, cfg=cfg, **kw: w4_triton.forward(x, w, config=cfg, **kw)
        checked_error(fwd, x, q0)
        us = us_per_call(fwd, x, qs)  # kernel + split-K sum
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
  q0, qs = rotating_weights(k, n)
  x = activations(8, k)
  base = w4_triton.default_config(8, k, n)
  line = []
  for splits in (1, 2, 3, 4, 6, 8, 12):
    if splits > k // base.block_k:
      continue
    cfg = dataclasses.replace(base, splits=splits)
    us = us_per_call(lambda x, w, cfg=cfg: w4_triton.forward(x, w, config=cfg), x, qs)
    line.append(f"s{splits} {us:5.1f}")
  print(f"{name:8s} M=8 tuned splits={base.splits} (sum of kernels per call, us): " + " | ".join(line), flush=True)

"""Lab: A/B device time of two versions of pallas_kernels/w4_triton.py in one process (GPU only).

  git show <commit>:pallas_kernels/w4_triton.py > .dev/lab/w4_old.py
  AB_OLD=.dev/lab/w4_old.py PYTHONPATH=$PWD python3 experiments/lab/ab_module.py

Each version's tuned forward, 7B shapes, M = 1, 8, 32: checked against the XLA reference on a
NaN-poisoned output, then the median kernel device time over a profiler trace of calls on
rotating weight copies (as experiments/lab/kernel_variants.py).
"""
import importlib.util, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax, jax.numpy as jnp, numpy as np
import devtime
from pallas_kernels import w4_triton as new
from pallas_kernels.matmul import reference_matmul
from qerl_jax import nvfp4

spec = importlib.util.spec_from_file_location("w4_old", os.environ["AB_OLD"])
old = importlib.util.module_from_spec(spec); sys.modules["w4_old"] = old; spec.loader.exec_module(old)
SHAPES = {"7b_qkv": (3584, 4608), "7b_o": (3584, 3584), "7b_gate": (3584, 18944), "7b_down": (18944, 3584)}
tot = {"old": 0.0, "new": 0.0}
for name, (k, n) in SHAPES.items():
  q0 = nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02)
  r = max(2, -(-(256 << 20) // (k * n // 2)))
  qs = [jax.tree.map(lambda a, i=i: a ^ jnp.uint8(i % 2) if a.dtype == jnp.uint8 else a, q0) for i in range(r)]
  for m in (1, 8, 32):
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    ref = reference_matmul(x, q0, out_dtype=jnp.float32)
    line = []
    for tag, mod in (("old", old), ("new", new)):
      y = mod.forward(x, q0, out_dtype=jnp.float32, poison_output=True)
      err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
      assert err < 1e-2 and not bool(jnp.isnan(y).any()), (tag, err)
      durs = devtime.trace_durations(jax.jit(lambda x, qs, mod=mod: [mod.forward(x, q) for q in qs]), x, qs)
      us = float(np.median([t for nm, ts in durs.items() if nm.startswith("w4a16_fwd") for t in ts]))
      tot[tag] += us
      line.append(f"{tag} {us:5.1f}us {(k * n * 9 / 16) / us / 1e3:5.0f}GB/s err {err:.1e}")
    print(f"{name:8s} M={m:2d}: " + " | ".join(line), flush=True)
print(f"summed: old {tot['old']:.1f}us new {tot['new']:.1f}us ({tot['new'] / tot['old'] - 1:+.1%})", flush=True)

"""Lab: device time of the LoRA down-projection ``x @ A`` ([M, K] bf16 x [K, R] bf16 -> f32) at decode M.

cuBLAS (launchers' flags: no Triton GEMM) picks a 2-CTA kernel for R = 64-96 that takes 13.8 µs at
K = 3584 in a batch-8 rollout. This times XLA formulations over rotating copies of A (beyond the L2)
and checks each against a float64 reference. Each copy of A is read from HBM (a scan over >= 128 MB
of stacked copies), as in a rollout; ``LORA_XA_MS`` picks the M values.

  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" PYTHONPATH=$PWD python3 experiments/lab/lora_xa.py
"""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax, jax.numpy as jnp, numpy as np
import devtime


def split_k(x, a, s):
  m, k = x.shape
  return jnp.einsum("msk,skr->smr", x.reshape(m, s, k // s), a.reshape(s, k // s, a.shape[1]),
                    preferred_element_type=jnp.float32).sum(0)


VARIANTS = {
    "dot": lambda x, a: jnp.dot(x, a, preferred_element_type=jnp.float32),
    "split16": lambda x, a: split_k(x, a, 16),
}
extra = os.environ.get("LORA_XA_EXTRA")
for spec in filter(None, (extra or "").split(",")):  # "module:function" taking (x, a) -> f32 [M, R]
  mod, fn = spec.split(":")
  VARIANTS[fn] = getattr(__import__(mod, fromlist=[fn]), fn)

ms = [int(v) for v in os.environ.get("LORA_XA_MS", "8,64,256").split(",")]
shapes = [(m, k, r) for m in ms for k, r in ((3584, 96), (3584, 64), (3584, 32), (18944, 32))]
print("| M | K | R | " + " | ".join(VARIANTS) + " |")
print("|---|---|---|" + "---|" * len(VARIANTS))
for m, k, r in shapes:
  x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
  a0 = (jax.random.normal(jax.random.key(k + r), (k, r), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  # C stacked copies (>= 128 MB, beyond the 60 MB L2), read one per iteration of a scan, as a
  # rollout reads one layer's A per step of its scan over layers.
  c = -(-(128 << 20) // (k * r * 2))
  stack = a0[None] + (jnp.arange(c, dtype=jnp.float32)[:, None, None] * 1e-3).astype(jnp.bfloat16)
  ref = np.asarray(x, np.float64) @ np.asarray(a0, np.float64)
  row = []
  for name, fn in VARIANTS.items():
    try:
      got = np.asarray(jax.jit(fn)(x, a0))
      err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
      assert err < 1e-3 and np.isfinite(got).all(), err
      durs = devtime.trace_durations(jax.jit(lambda x, st: jax.lax.map(lambda a: fn(x, a), st)), x, stack)
      row.append(f"{sum(sum(v) for v in durs.values()) / c:.1f}")
    except Exception as e:  # noqa: BLE001 - a lab table reports each variant's failure
      row.append(f"FAIL {type(e).__name__}")
  print(f"| {m} | {k} | {r} | " + " | ".join(row) + " |", flush=True)

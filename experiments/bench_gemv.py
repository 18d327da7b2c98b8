"""Benchmark of the split-K GEMV (``pallas_kernels.w4_gemv``) for decode-size M.

One call does: a tile/split sweep on a few layer shapes (the best config per M
bucket is then used), then one table over Qwen2.5-7B/32B layer shapes and M in
--ms: the GEMV's time, its effective bandwidth, and in the same run bf16
``jnp.dot``, the existing fused kernel (``w4_triton.forward``) and XLA
dequantize-then-dot (``reference_matmul``). Each row is first checked against
the reference (relative error, NaN; the deterministic partials variant writes
into a NaN-poisoned buffer). Timing is the harness of
``experiments/bench_kernels.py`` (R weight copies per program so no weight is
served from L2, median over --reps samples of --inner back-to-back dispatches).

Usage (on the GPU):
  PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python3 experiments/bench_gemv.py --gemv_json /tmp/gemv.json
  python3 experiments/bench_gemv.py --smoke        # CPU dry run in interpret mode
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp

import bench_kernels as bk
from pallas_kernels import matmul, w4_gemv, w4_triton

FLAGS = flags.FLAGS
flags.DEFINE_string("gemv_json", "", "write sweep and table rows here")
flags.DEFINE_string("sweep_shapes", "7b:gate,7b:o", "model:layer pairs for the sweep")
flags.DEFINE_integer("budget_s", 270, "stop starting new rows after this many seconds")

C = w4_gemv.GemvConfig
CONFIGS = {
    "fma_n128_k64": C(128, 64, 528, 4, 4, "fma"),
    "fma_n128_k32": C(128, 32, 1056, 4, 4, "fma"),
    "fma_n256_k64_w8": C(256, 64, 528, 8, 3, "fma"),
    "dot_n64_k128": C(64, 128, 528, 4, 3, "dot"),
    "dot_n128_k128": C(128, 128, 528, 4, 3, "dot"),
    "fma_n128_k128": C(128, 128, 528, 4, 3, "fma"),
    "defer_n128_k64": C(128, 64, 528, 4, 4, "fma_defer"),
    "defer_n256_k64_w8": C(256, 64, 528, 8, 4, "fma_defer"),
    "fma_n128_k64_partials": C(128, 64, 528, 4, 4, "fma", "partials"),
}
DEFER_MAX_M = 2
FMA_MAX_M = 8
T0 = time.time()


def _cfgs_for(m):
  return {k: v for k, v in CONFIGS.items()
          if v.mode == "dot" or (v.mode == "fma" and m <= FMA_MAX_M) or m <= DEFER_MAX_M}


def _check(x, wq, cfg, interpret):
  ref = matmul.reference_matmul(x, wq)
  y = w4_gemv.gemv(x, wq, config=cfg, interpret=interpret)
  yp = w4_gemv.gemv(x, wq, config=cfg, interpret=interpret, poison_output=True)
  nan = bool(jnp.isnan(y).any()) or bool(jnp.isnan(yp).any())
  return max(bk._rel(y, ref), bk._rel(yp, ref)), nan


def _row(model, layer, k, n, m, wb, wq, cfgs, extra, interpret):
  x = jax.random.normal(jax.random.PRNGKey(m * 7 + k), (m, k), jnp.float32).astype(jnp.bfloat16)
  r = int(max(1, min(32, -(-FLAGS.rotate_mb * 2**20 // wq.nbytes))))
  wqs, wbs = bk._copies(wq, r), bk._copies(wb, r)
  d = dict(model=model, layer=layer, K=k, N=n, M=m, R=r)
  t = lambda f, ws: bk._time(f, x, ws, FLAGS.reps, FLAGS.inner) * 1e6
  for name, cfg in cfgs.items():
    err, nan = _check(x, wq, cfg, interpret)
    d[f"err_{name}"], d[f"nan_{name}"] = err, nan
    d[f"us_{name}"] = t(lambda x, w, cfg=cfg: w4_gemv.gemv(x, w, config=cfg, interpret=interpret), wqs)
  d["us_bf16"] = t(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16), wbs)
  if "fused" in extra:
    d["us_fused"] = t(lambda x, w: w4_triton.forward(x, w, interpret=interpret), wqs)
  if "xla" in extra:
    d["us_xla"] = t(lambda x, w: matmul.reference_matmul(x, w), wqs)
  d["bytes_w4"] = int(wq.nbytes + m * (k + n) * 2)
  return d


def main(argv):
  del argv
  interpret = FLAGS.smoke
  ms = [int(v) for v in FLAGS.ms.split(",")]
  shapes = bk.SHAPES
  if FLAGS.smoke:
    shapes = {"7b": {"o": (256, 192)}}
    FLAGS.sweep_shapes = "7b:o"
  out = {"sweep": [], "table": [], "best": {}}
  save = lambda: FLAGS.gemv_json and json.dump(out, open(FLAGS.gemv_json, "w"), indent=1)
  print(f"jax {jax.__version__} devices {jax.devices()}", flush=True)
  weights = {}

  def get(model, layer):
    if (model, layer) not in weights:
      k, n = shapes[model][layer]
      weights[(model, layer)] = bk._weights(k, n, hash((model, layer)) % 1000)
    return weights[(model, layer)]

  # 1. sweep
  print("## sweep (us per call; bf16 in the same run)", flush=True)
  for ml in FLAGS.sweep_shapes.split(","):
    model, layer = ml.split(":")
    k, n = shapes[model][layer]
    wb, wq = get(model, layer)
    for m in ms:
      if time.time() - T0 > FLAGS.budget_s * 0.45:
        break
      d = _row(model, layer, k, n, m, wb, wq, _cfgs_for(m), (), interpret)
      out["sweep"].append(d)
      save()
      cols = " ".join(f"{c}={d[f'us_{c}']:.1f}({d[f'err_{c}']:.0e}{'NaN' if d[f'nan_{c}'] else ''})"
                      for c in _cfgs_for(m))
      print(f"{model} {layer} {k}x{n} M={m} bf16={d['us_bf16']:.1f} {cols}", flush=True)
  # best config per M: geometric mean of (bf16 / config) over sweep shapes
  for m in ms:
    rows = [d for d in out["sweep"] if d["M"] == m]
    if not rows:
      continue
    score = {c: sum(jnp.log(d["us_bf16"] / d[f"us_{c}"]) for d in rows) / len(rows)
             for c in _cfgs_for(m) if not c.endswith("partials")
             and not any(d[f"nan_{c}"] or d[f"err_{c}"] > 1e-2 for d in rows)}
    if score:
      out["best"][m] = max(score, key=lambda c: score[c])
  print("best:", out["best"], flush=True)
  save()
  # 2. table
  print("\n| model | layer | K x N | M | gemv cfg | gemv us | gemv GB/s | bf16 us | fused us | XLA deq+dot us "
        "| vs bf16 | vs fused | vs XLA | rel err |\n|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        flush=True)
  for m in ms:  # M outer: if the budget runs out, every shape has its small-M rows
    for model in FLAGS.models.split(","):
      for layer in FLAGS.layers.split(","):
        if layer not in shapes[model]:
          continue
        k, n = shapes[model][layer]
        wb, wq = get(model, layer)
        if time.time() - T0 > FLAGS.budget_s or m not in out["best"]:
          continue
        c = out["best"][m]
        d = _row(model, layer, k, n, m, wb, wq, {c: CONFIGS[c]}, ("fused", "xla"), interpret)
        d["cfg"] = c
        out["table"].append(d)
        save()
        g = d[f"us_{c}"]
        print(f"| {model} | {layer} | {k}x{n} | {m} | {c} | {g:.1f} | {d['bytes_w4'] / g / 1e3:.0f} | "
              f"{d['us_bf16']:.1f} | {d['us_fused']:.1f} | {d['us_xla']:.1f} | {d['us_bf16'] / g:.2f}x | "
              f"{d['us_fused'] / g:.2f}x | {d['us_xla'] / g:.2f}x | {d[f'err_{c}']:.1e}"
              f"{' NaN!' if d[f'nan_{c}'] else ''} |", flush=True)
  print(f"done in {time.time() - T0:.0f} s", flush=True)


if __name__ == "__main__":
  sys.argv += [] if any(a.startswith("--ms") for a in sys.argv) else ["--ms=1,8,16,32"]
  app.run(main)

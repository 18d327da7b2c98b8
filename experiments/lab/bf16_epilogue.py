"""Lab (GPU): the model's 4-bit linears at large M (prefill, the training forward and backward) with
``layers.BF16_EPILOGUE`` on (the GEMM's bf16 output with the bias and LoRA delta as its addend) and off (float32
product, float32 delta, then a cast), as the decoder calls them: 7B q/k/v (fused, bias, per-part adapters), o,
gate/up (fused, per-part adapters) and down, LoRA rank 32. Device time (µs) of the forward and of its VJP (x and the
adapters' cotangents, the backward pass of a training step), after a check of both routes against each other; then
the compiled forward's cuBLAS calls for one shape (their output types, and whether the addend went in as C).

  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true" \
      PYTHONPATH=$PWD python3 experiments/lab/bf16_epilogue.py
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from labcommon import activations  # noqa: E402
import devtime  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from qerl_jax import nvfp4  # noqa: E402
from qerl_jax.models import layers  # noqa: E402

D, F, Q, KV, R = 3584, 18944, 3584, 512, 32
MS = [int(m) for m in os.environ.get("LAB_MS", "2048,8192").split(",")]


def _w(key, k, n):
  return nvfp4.to_decode_order(nvfp4.quantize(jax.random.normal(jax.random.key(key), (k, n), jnp.float32) * 0.02))


def _ad(key, k, n):
  ka, kb = jax.random.split(jax.random.key(100 + key))
  return {"a": 0.02 * jax.random.normal(ka, (k, R), jnp.float32), "b": 0.02 * jax.random.normal(kb, (R, n))}


SHAPES = {
    "qkv": (D, (Q, KV, KV), True),
    "o": (Q, (D,), False),
    "gate_up": (D, (F, F), False),
    "down": (F, (D,), False),
}


def _case(name):
  k, sizes, has_bias = SHAPES[name]
  w = _w(len(name), k, sum(sizes))
  bias = (0.1 * jax.random.normal(jax.random.key(7), (sum(sizes),))).astype(jnp.bfloat16) if has_bias else None
  loras = tuple(_ad(i, k, s) for i, s in enumerate(sizes))
  if len(sizes) == 1:
    def f(x, p):
      return (layers.linear(x, p["w"], bias=p["bias"], lora=p["loras"][0], lora_scale=2.0),)
  else:
    def f(x, p):
      return layers.fused_linear(x, p["w"], sizes, bias=p["bias"], loras=p["loras"], lora_scale=2.0)
  return k, sizes, {"w": w, "bias": bias, "loras": loras}, f  # (arguments, not constants of the executable)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
  rows = []
  for name in SHAPES:
    k, sizes, params, f = _case(name)
    for m in MS:
      x = activations(m, k)
      cts = tuple(jax.random.normal(jax.random.key(50 + i), (m, s), jnp.bfloat16) for i, s in enumerate(sizes))
      res = {}
      for route in (False, True):
        layers.BF16_EPILOGUE = route
        fwd = jax.jit(lambda x, p: f(x, p))  # a new function a route: jit's trace cache is keyed on the function
        bwd = jax.jit(lambda x, p, cts: jax.vjp(lambda x, l: f(x, {**p, "loras": l}), x, p["loras"])[1](cts))
        out, g = fwd(x, params), bwd(x, params, cts)
        res[route] = (out, g, devtime.device_time(fwd, x, params) or np.nan,
                      devtime.device_time(bwd, x, params, cts) or np.nan)
      err = max(_rel(a, b) for a, b in zip(res[True][0], res[False][0]))
      gerr = max(_rel(a, b) for a, b in zip(jax.tree.leaves(res[True][1]), jax.tree.leaves(res[False][1])))
      (_, _, f0, b0), (_, _, f1, b1) = res[False], res[True]
      rows.append((name, m, f0 * 1e6, f1 * 1e6, b0 * 1e6, b1 * 1e6, err, gerr))
      print(f"{name:8s} M={m:5d} fwd {f0 * 1e6:8.1f} -> {f1 * 1e6:8.1f} µs  vjp {b0 * 1e6:8.1f} -> {b1 * 1e6:8.1f} µs"
            f"  rel.diff out {err:.1e} grads {gerr:.1e}", flush=True)
  print("\n| matrix | M | forward, float32 route µs | bf16 route µs | ratio | VJP float32 route µs | bf16 route µs "
        "| ratio | rel. diff out / grads |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
  for name, m, f0, f1, b0, b1, err, gerr in rows:
    print(f"| {name} | {m} | {f0:.1f} | {f1:.1f} | {f0 / f1:.2f}x | {b0:.1f} | {b1:.1f} | {b0 / b1:.2f}x "
          f"| {err:.1e} / {gerr:.1e} |")
  for name, s in rows_sum(rows).items():
    print(f"sum at M={name}: forward {s[0]:.1f} -> {s[1]:.1f} µs ({s[0] / s[1]:.2f}x), "
          f"VJP {s[2]:.1f} -> {s[3]:.1f} µs ({s[2] / s[3]:.2f}x)")
  # the compiled forward's GEMMs, one shape
  k, sizes, params, f = _case("gate_up")
  x = activations(MS[0], k)
  for route in (False, True):
    layers.BF16_EPILOGUE = route
    text = jax.jit(lambda x, p: f(x, p)).lower(x, params).compile().as_text()
    calls = [line.strip() for line in text.splitlines() if "custom_call_target=\"__cublas" in line]
    print(f"\ngate_up M={MS[0]} BF16_EPILOGUE={route}: {len(calls)} cuBLAS calls")
    for line in calls:
      out = line.split("=", 1)[1].split("custom-call", 1)[0].strip()
      beta = re.search(r'"beta":([0-9.]+)', line)
      alias = "output_to_operand_aliasing" in line
      print(f"  {out[:90]}  beta={beta.group(1) if beta else '?'} aliased={alias}")


def rows_sum(rows):
  out = {}
  for name, m, f0, f1, b0, b1, *_ in rows:
    s = out.setdefault(m, [0.0, 0.0, 0.0, 0.0])
    s[0] += f0
    s[1] += f1
    s[2] += b0
    s[3] += b1
  return out


if __name__ == "__main__":
  main()

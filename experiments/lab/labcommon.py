"""Shared setup of the GPU lab scripts: 7B layer shapes, rotating weight copies, checked timing."""
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import devtime  # noqa: E402
from pallas_kernels.matmul import reference_matmul  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

SHAPES_7B = {"7b_qkv": (3584, 4608), "7b_o": (3584, 3584), "7b_gate": (3584, 18944), "7b_down": (18944, 3584)}


WEIGHT_MB = int(os.environ.get("LAB_WEIGHT_MB", 256))  # 0: two copies, which the L2 holds for the small 7B matrices


def rotating_weights(k: int, n: int, min_mb: int | None = None):
  """(q0, copies): an NVFP4 ``[k, n]`` weight and enough distinct copies (codes XOR 1 on odd ones)
  to hold ``min_mb`` MiB of codes (default ``LAB_WEIGHT_MB``, 256), so timed calls never hit the L2;
  with ``LAB_WEIGHT_MB=0`` two copies, so that matrices of up to about 20 MB (7B q/k/v, o) are read from the L2."""
  min_mb = WEIGHT_MB if min_mb is None else min_mb
  q0 = nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02)
  r = max(2, -(-(min_mb << 20) // (k * n // 2)))
  copies = [jax.tree.map(lambda a, i=i: a ^ jnp.uint8(i % 2) if a.dtype == jnp.uint8 else a, q0)
            for i in range(r)]
  return q0, copies


def dense_copies(k: int, n: int, min_mb: int = 512):
  """Distinct bf16 ``[k, n]`` weights holding at least ``min_mb`` MiB (at least 2), for timing bf16
  matmuls beyond the L2 as :func:`rotating_weights` does for the 4-bit ones."""
  return [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16)
          for i in range(max(2, (min_mb << 20) // (k * n * 2)))]


def activations(m: int, k: int):
  """bf16 ``[m, k]`` standard-normal activations."""
  return jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)


def matmul_cases(shapes: dict, ms):
  """``(name, k, n, m, x, q0, copies, dense, ref)`` for every ``name: (k, n)`` of ``shapes`` and every
  ``m`` of ``ms``: the 4-bit weight and its rotating copies, bf16 copies (made once a shape), the
  activations, and the XLA reference product ``x @ q0`` in float32."""
  for name, (k, n) in shapes.items():
    q0, copies = rotating_weights(k, n)
    dense = dense_copies(k, n)
    for m in ms:
      x = activations(m, k)
      yield name, k, n, m, x, q0, copies, dense, reference_matmul(x, q0, out_dtype=jnp.float32)


def checked_error(forward, x, q0) -> float:
  """Relative error of ``forward(x, q0, out_dtype=f32, poison_output=True)`` vs the XLA reference;
  AssertionError above 1e-2 or with any NaN left in the poisoned output."""
  ref = reference_matmul(x, q0, out_dtype=jnp.float32)
  y = forward(x, q0, out_dtype=jnp.float32, poison_output=True)
  err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
  assert err < 1e-2 and not bool(jnp.isnan(y).any()), err
  return err


def us_per_call(fn, x, copies) -> float:
  """Device time (µs) of all kernels of ``fn(x, w)`` per copy, from one traced call over all copies, each with its
  own copy of ``x`` (one shared ``x`` lets XLA rewrite the calls together: session 55 found bf16 dots of the 7B
  q/k/v and o 2.5x slower that way in bench_kernels.py)."""
  xs = [x.copy() for _ in copies]
  durs = devtime.trace_durations(jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)]), xs, copies)
  return float(sum(sum(v) for v in durs.values())) / len(copies)


def check_small_m_forward(forward, cases, interpret: bool) -> None:
  """Checks a lab small-M forward ``forward(x, w, interpret=..., **kw) -> float32 [M, N]`` against
  ``reference_matmul`` on fresh NVFP4 weights, for ``cases`` of ``(m, k, n, kw)``; in interpret mode
  the large cases are skipped. AssertionError above 1e-2 relative error or with a non-finite value."""
  import numpy as np
  for m, k, n, kw in cases:
    if interpret and k * n > 2e6:
      continue
    q = nvfp4.quantize(jax.random.normal(jax.random.key(m + n), (k, n), jnp.float32) * 0.02)
    x = jax.random.normal(jax.random.key(k), (m, k), jnp.float32).astype(jnp.bfloat16)
    y = forward(x, q, interpret=interpret, **kw)
    ref = np.asarray(reference_matmul(x, q, out_dtype=jnp.float32), np.float64)
    err = np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-2 and np.isfinite(np.asarray(y)).all(), (m, k, n, err)
    print(f"check M={m} K={k} N={n} {kw}: rel err {err:.1e}", flush=True)


def time_against_tuned(variants: dict, ms) -> None:
  """Device time (µs) of ``variants`` ``{tag: forward(x, w)}`` and the tuned ``w4_triton.forward`` at the
  7B shapes and the given M, per shape and summed over the four shapes."""
  from pallas_kernels import w4_triton
  totals = {}
  for name, (k, n) in SHAPES_7B.items():
    _, qs = rotating_weights(k, n)
    for m in ms:
      x = activations(m, k)
      row = {"tuned": us_per_call(lambda x, w: w4_triton.forward(x, w, out_dtype=jnp.float32), x, qs)}
      row.update({tag: us_per_call(fn, x, qs) for tag, fn in variants.items()})
      for key, v in row.items():
        totals[(m, key)] = totals.get((m, key), 0.0) + v
      print(f"{name:8s} M={m:2d} " + " | ".join(f"{key} {v:6.1f}" for key, v in row.items()), flush=True)
  print("\nsummed over the four 7B shapes (µs):")
  for m in ms:
    print(f"M={m:2d} " + " | ".join(f"{key} {v:6.1f}" for (mm, key), v in totals.items() if mm == m), flush=True)


def set_module_settings(env: str, module) -> None:
  """Replaces ``module``'s settings from the environment variable ``env``, ``"NAME=int,NAME=int"`` (the lab
  scripts' ``GL_SET`` / ``MODEL_SET`` / ``DA_SET``), printing each; exits naming a setting the module lacks. A
  setting that holds a string (``pallas_kernels.matmul``'s ``"0"`` / ``"1"`` switches) gets the text as given."""
  for assign in filter(None, os.environ.get(env, "").split(",")):
    name, value = assign.split("=")
    if not hasattr(module, name):
      raise SystemExit(f"{module.__name__} has no setting {name}")
    value = value if isinstance(getattr(module, name), str) else int(value)
    setattr(module, name, value)
    print(f"{module.__name__}.{name} = {value!r}", flush=True)

"""Quantize-time benchmark for the 4-bit weight formats (prints a table).

  PYTHONPATH=. python experiments/bench_quantize.py [--k 28672 --n 8192]

Times ``nvfp4.quantize`` and ``nf4.quantize`` on a bf16 Gaussian ``[K, N]`` matrix
(default 28672 x 8192, a Qwen2.5-32B-sized MLP projection): the first call
(includes XLA compilation) and the best of three warm calls, in seconds of wall time and
of CPU time summed over threads (the latter is steadier on a shared machine).
"""

import argparse
import time

import jax
import jax.numpy as jnp

from qerl_jax import nf4, nvfp4


def _time(fn, w):
  t0 = time.perf_counter()
  jax.block_until_ready(fn(w))
  first = time.perf_counter() - t0
  warm, cpu = [], []
  for _ in range(3):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(w))
    warm.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return first, min(warm), min(cpu)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--k", type=int, default=28672)
  p.add_argument("--n", type=int, default=8192)
  a = p.parse_args()
  w = jax.random.normal(jax.random.key(0), (a.k, a.n), jnp.bfloat16)
  w.block_until_ready()
  print(f"device: {jax.devices()[0].device_kind}  matrix: {a.k} x {a.n} bf16")
  print(f"{'format':8s} {'first call (s)':>15s} {'warm (s)':>10s} {'warm CPU (s)':>13s} {'Gweights/s warm':>16s}")
  for name, fn in (("nvfp4", nvfp4.quantize), ("nf4", nf4.quantize)):
    first, warm, cpu = _time(fn, w)
    print(f"{name:8s} {first:15.3f} {warm:10.3f} {cpu:13.3f} {a.k * a.n / warm / 1e9:16.3f}")


if __name__ == "__main__":
  main()

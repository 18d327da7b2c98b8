"""Lab (GPU): device time of the swap-AB forward (``offline_sass_swapab.forward``) against the tuned
``w4_triton.forward`` and bf16 at the 7B shapes, M = 1, 8, 16, 32.

Each variant is first checked against ``reference_matmul`` (the asm decode only runs on a GPU):
relative error < 1e-2, all finite. Then device time per call (``labcommon.us_per_call``: kernels
of the call summed, over rotating weight copies beyond the L2), split-K chosen per shape so the
grid has about ``target`` programs. The codes/scales are transposed once, outside the timed call
(a real integration would store them K-contiguous).

  PYTHONPATH=$PWD python3 experiments/lab/time_swapab.py
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from labcommon import SHAPES_7B, activations, rotating_weights, us_per_call  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import offline_sass_swapab as sab  # noqa: E402
from pallas_kernels import w4_triton  # noqa: E402
from pallas_kernels.matmul import reference_matmul  # noqa: E402

VARIANT_SETS = {  # tag: forward kwargs (layout "nk" unless given)
    "small": {
        "bm8_bk128_s3": dict(bm=8, bn=128, bk=128, num_stages=3),
        "bm8_bk128_s2": dict(bm=8, bn=128, bk=128, num_stages=2),
        "bm8_bk256_s3": dict(bm=8, bn=128, bk=256, num_stages=3),
        "bm8_bn64_bk128": dict(bm=8, bn=64, bk=128, num_stages=3),
        "bm16_perm_s2": dict(bm=16, bn=128, bk=128, num_stages=2, permute=True),
    },
    "wgmma": {  # wgmma with the decoded weight as the register A operand (bm % 16 == 0, permute)
        "kn_bm16": dict(layout="kn", bm=16, bn=128, bk=128, num_stages=2, permute=True),
        "kn_bm32": dict(layout="kn", bm=32, bn=128, bk=128, num_stages=2, permute=True),
        "kn_bm64": dict(layout="kn", bm=64, bn=128, bk=128, num_stages=2, permute=True),
        "kn_bm64_bn64": dict(layout="kn", bm=64, bn=64, bk=128, num_stages=3, permute=True),
        "nk_bm16": dict(bm=16, bn=128, bk=128, num_stages=2, permute=True),
        "nk_bm64": dict(bm=64, bn=128, bk=128, num_stages=2, permute=True),
    },
    "large": {  # M = 128, 256: one or two row tiles per weight tile (the decode is not repeated per 64 rows)
        "bm64_bn64": dict(layout="kn", bm=64, bn=64, bk=128, num_stages=3, permute=True),
        "bm128_bn64": dict(layout="kn", bm=128, bn=64, bk=128, num_stages=3, permute=True),
        "bm128_bn64_s2": dict(layout="kn", bm=128, bn=64, bk=128, num_stages=2, permute=True),
        "bm128_bn128_w8": dict(layout="kn", bm=128, bn=128, bk=128, num_stages=3, num_warps=8, permute=True),
        "bm256_bn64": dict(layout="kn", bm=256, bn=64, bk=128, num_stages=2, permute=True),
        "bm256_bn128_w8": dict(layout="kn", bm=256, bn=128, bk=128, num_stages=2, num_warps=8, permute=True),
        "bm128_bn64_bk64": dict(layout="kn", bm=128, bn=64, bk=64, num_stages=4, permute=True),
    },
    "plain_nk": {  # no swap: acc [bm, bn] += x @ decode([bn, bk/2]).T, codes K-contiguous
        "nk_plain_16x128x64": dict(bm=16, bn=128, bk=64, num_stages=3, swap=False),
        "nk_plain_16x128x128": dict(bm=16, bn=128, bk=128, num_stages=3, swap=False),
        "nk_plain_32x128x64": dict(bm=32, bn=128, bk=64, num_stages=3, swap=False),
        "nk_plain_64x64x128": dict(bm=64, bn=64, bk=128, num_stages=3, swap=False),
        "nk_plain_64x128x64": dict(bm=64, bn=128, bk=64, num_stages=3, swap=False),
        "nk_swap_8x64x128": dict(bm=8, bn=64, bk=128, num_stages=3),
        "nk_swap_8x128x256": dict(bm=8, bn=128, bk=256, num_stages=3),
    },
}
VARIANTS = VARIANT_SETS[os.environ.get("SWAPAB_SET", "small")]


def pick_splits(k, bk, programs, target):
  steps = k // bk
  divs = [d for d in range(1, steps + 1) if steps % d == 0]
  return min(divs, key=lambda d: abs(math.log(programs * d / target)))


def main():
  ms = [int(v) for v in os.environ.get("SWAPAB_MS", "1,8,16,32").split(",")]
  targets = [int(v) for v in os.environ.get("SWAPAB_TARGETS", "528,1056").split(",")]
  totals = {}
  for name, (k, n) in SHAPES_7B.items():
    q0, qs = rotating_weights(k, n)
    ops = {lay: [sab.operands(q, lay) for q in qs] for lay in ("nk", "kn")}
    ws = [jnp.zeros((k, n), jnp.bfloat16) + i for i in range(max(2, -(-(256 << 20) // (k * n * 2))))]
    for m in ms:
      x = activations(m, k)
      ref = reference_matmul(x, q0, out_dtype=jnp.float32)
      row = {"tuned": us_per_call(lambda x, w: w4_triton.forward(x, w, out_dtype=jnp.float32), x, qs),
             "bf16": us_per_call(jnp.dot, x, ws)}
      for tag, kw in VARIANTS.items():
        if kw["bm"] > max(16, 2 * m):
          continue
        lay_ops = ops[kw.get("layout", "nk")]
        best = None
        for target in targets:
          programs = n // kw["bn"] * -(-m // kw["bm"])
          splits = pick_splits(k, kw["bk"], programs, target)
          fn = lambda x, o, s=splits, kw=kw: sab.forward(x, *o, splits=s, **kw)
          try:
            y = fn(x, lay_ops[0])
            err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
            assert err < 1e-2 and bool(jnp.isfinite(y).all()), err
            us = us_per_call(fn, x, lay_ops)
          except Exception as e:  # a lab: report and go on
            print(f"  {name} M={m} {tag} splits={splits}: FAIL {repr(e)[:200]}", flush=True)
            continue
          if best is None or us < best[0]:
            best = (us, splits, err)
        if best:
          row[tag] = best[0]
          row[tag + "_splits"] = best[1]
      for key, v in row.items():
        if not key.endswith("_splits"):
          totals.setdefault((m, key), 0.0)
          totals[(m, key)] += v
      print(f"{name:8s} M={m:2d} " + " | ".join(
          f"{key} {v:6.1f}" + (f" (s{row[key + '_splits']})" if key + "_splits" in row else "")
          for key, v in row.items() if not key.endswith("_splits")), flush=True)
  print("\nsummed over the four 7B shapes (µs):")
  for m in ms:
    print(f"M={m:2d} " + " | ".join(f"{key} {v:6.1f}" for (mm, key), v in totals.items() if mm == m), flush=True)


if __name__ == "__main__":
  main()

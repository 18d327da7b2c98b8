"""Lab (GPU): small-M forward variants that keep more loads in flight or more warps resident.

Session 6 left one reading of the small-M kernel standing: it waits on dependency chains that too
few resident warps hide (docs/benchmarks.md, session 6). These variants of the tuned M <= 32 tile
(16 x 128 x 64, 4 warps, 3 stages, 95 registers) test it; registers and instructions per weight
value from offline sm_90 SASS (experiments/lab/offline_sass.py):

  s4, s5     4 or 5 pipeline stages: more bytes in flight per program (95 registers, 6.02/value)
  k32        block_k 32: 71 registers (about 7 programs an SM instead of 5), 6.97/value
  k32_2k     block_k 32 with twice the programs (split-K)
  w8         8 warps on the same tile: 66 registers a thread, 7.00/value
  w2_n64     2 warps, block_n 64: 82 registers, 5.89/value
  k128_s4    block_k 128 with 4 stages: twice the bytes per stage (session 7)
  n256_s4    block_n 256 with 4 stages (session 7)
  s6         6 stages (session 7)

Every variant is first checked against ``reference_matmul`` (NaN-poisoned output, ragged shapes),
then timed per call at the 7B shapes (``labcommon.time_against_tuned``).

  PYTHONPATH=$PWD python3 experiments/lab/time_occupancy.py     # OCC_MS=1,8,32
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from labcommon import check_small_m_forward, time_against_tuned  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import w4_triton  # noqa: E402

VARIANTS = {  # TileConfig fields changed from the tuned config; "programs_x" scales the split count
    "s4": dict(num_stages=4),
    "s5": dict(num_stages=5),
    "k32": dict(block_k=32),
    "k32_2k": dict(block_k=32, programs_x=2),
    "w8": dict(num_warps=8),
    "w2_n64": dict(num_warps=2, block_n=64),
    "k128_s4": dict(block_k=128, num_stages=4),
    "n256_s4": dict(block_n=256, num_stages=4),
    "s6": dict(num_stages=6),
}
MS = [int(v) for v in os.environ.get("OCC_MS", "1,8,32").split(",")]


def variant(fields, poison=False):
  fields = dict(fields)
  scale = fields.pop("programs_x", 1)

  def forward(x, w, interpret=False, **kw):
    m, (k, n) = x.shape[0], w.shape
    cfg = dataclasses.replace(w4_triton.default_config(m, k, n), **fields)
    base = w4_triton.default_config(m, k, n)
    # about the tuned program count (times programs_x): a narrower block_n already has more tiles
    splits = max(1, min(32, k // (2 * cfg.block_k), base.splits * scale * cfg.block_n // base.block_n))
    cfg = dataclasses.replace(cfg, splits=splits)
    return w4_triton.forward(x, w, config=cfg, interpret=interpret, out_dtype=jnp.float32,
                             poison_output=poison, **kw)
  return forward


if __name__ == "__main__":
  interpret = jax.default_backend() == "cpu"
  cases = [(1, 160, 40, {}), (8, 1040, 200, {}), (17, 256, 72, {}), (3, 3584, 4608, {}), (32, 18944, 3584, {})]
  for tag, fields in VARIANTS.items():
    print(f"== {tag}", flush=True)
    check_small_m_forward(variant(fields, poison=True), cases, interpret)
  if not interpret:
    time_against_tuned({tag: (lambda x, w, f=variant(fields): f(x, w)) for tag, fields in VARIANTS.items()}, MS)

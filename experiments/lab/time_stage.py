"""Lab (GPU): the forward kernel with ``TileConfig(stage="decoded")`` against the tuned one.

With ``stage="codes"`` (the tuned kernels) Triton moves the tensor-core operand's layout conversion
onto the packed uint8 codes: they go through shared memory and come back one byte at a time
(``LDS.U8``, 40 a thread and K step at M = 8), and the decode runs in the operand layout. A select
on the decoded bf16 tile (``stage="decoded"``) stops that move: each thread decodes the bytes it
loaded, stores bf16 with 16-byte stores, and ``ldmatrix`` reads the operand. Offline sm_90 SASS
(experiments/lab/offline_sass.py) at M = 8: no ``LDS.U8``; 6.61 instructions per weight value
(tuned: 6.02), 5.92 with prefetch (codes loaded straight into registers), 5.85 with prefetch and
block_k 128.

Every variant is first checked against ``reference_matmul`` (NaN-poisoned output, ragged shapes
included), then timed per call at the 7B shapes (``labcommon.time_against_tuned``).

  PYTHONPATH=$PWD python3 experiments/lab/time_stage.py      # STAGE_MS=1,8,16,32,64
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from labcommon import check_small_m_forward, time_against_tuned  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import w4_triton  # noqa: E402

VARIANTS = {  # TileConfig fields changed from the tuned config of each shape
    "dec": dict(stage="decoded"),
    "dec_pf": dict(stage="decoded", prefetch=True),
    "dec_pf_k128": dict(stage="decoded", prefetch=True, block_k=128),
}
MS = [int(v) for v in os.environ.get("STAGE_MS", "1,8,16,32,64").split(",")]


def variant(fields, poison=False):
  def forward(x, w, interpret=False, **kw):
    cfg = dataclasses.replace(w4_triton.default_config(x.shape[0], *w.shape), **fields)
    return w4_triton.forward(x, w, config=cfg, interpret=interpret, out_dtype=jnp.float32,
                             poison_output=poison, **kw)
  return forward


if __name__ == "__main__":
  interpret = jax.default_backend() == "cpu"
  cases = [(1, 160, 40, {}), (8, 1040, 200, {}), (17, 256, 72, {}), (3, 3584, 4608, {}), (32, 18944, 3584, {}),
           (64, 3584, 4100, {})]
  for tag, fields in VARIANTS.items():
    print(f"== {tag}", flush=True)
    check_small_m_forward(variant(fields, poison=True), cases, interpret)
  if not interpret:
    time_against_tuned({tag: (lambda x, w, f=variant(fields): f(x, w)) for tag, fields in VARIANTS.items()}, MS)

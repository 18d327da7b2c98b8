"""Lab (no GPU): the SASS cost of a weight in the main K loops of the large-M Gluon forward (w4_gluon_mm) and of the
decode GEMV (w4_gluon), compiled for sm_90 as the library would launch them (7B gate/up, a 28-layer stack).

For each build it finds the innermost loops (backward branches) that hold the tensor-core instructions and prints,
per 8 weights a thread decodes (two HMUL2 a pair of weights: the block-scale multiply), all instructions and the
decode-side ones (integer and half-precision arithmetic, conversions). The GEMV is fully unrolled, so its whole
build is counted. Session 52 used it to compare the narrow tiles' decode with the GEMV's.

  python3 experiments/lab/gluon/offline_mm.py   # large-M forward M = 64, 128, 2048 (both code orders; DECODE 4, 5),
                                                # GEMV M = 8-64
"""
import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pallas_kernels import w4_gluon, w4_gluon_mm  # noqa: E402
from sasstool import instructions, opcode, sass  # noqa: E402

DECODE_SIDE = ("LOP3", "PRMT", "SHF", "IMAD", "HMUL2", "F2FP", "IADD3", "LEA", "VIADD", "HADD2", "FMUL")


def per_8_weights(body):
  """(instructions, decode-side instructions) per 8 weights a thread decodes in ``body``."""
  weights = 2 * sum("HMUL2" in t for _, t in body)
  ops = collections.Counter(opcode(t) for _, t in body)
  side = sum(v for k, v in ops.items() if k.split(".")[0] in DECODE_SIDE)
  return 8 * len(body) / weights, 8 * side / weights, ops


def mma_loops(text):
  """The backward-branch loops of a listing that hold wgmma or mma instructions and the decode, but no epilogue
  (no global store or reduction): ``[(start, body)]``."""
  ins = instructions(text)
  at = {a: i for i, (a, _) in enumerate(ins)}
  loops = []
  for i, (a, t) in enumerate(ins):
    m = re.search(r"BRA\s+0x([0-9a-f]+)", t)
    if m and int(m.group(1), 16) < a:
      body = ins[at[int(m.group(1), 16)]:i + 1]
      epilogue = any(x.split()[0].startswith(("REDG", "STG")) or " REDG" in x or " STG" in x for _, x in body)
      if any("MMA" in x for _, x in body) and any("HMUL2" in x for _, x in body) and not epilogue:
        loops.append((int(m.group(1), 16), body))
  return loops


if __name__ == "__main__":
  os.makedirs("/tmp/gl", exist_ok=True)
  saved = (w4_gluon_mm.DECODE, w4_gluon_mm.NARROW_DECODE, w4_gluon_mm.WIDE_DECODE)
  # each build by its DECODE: 2 unpaired, 4 the GEMV's pairing (session 52), 5 repaired in registers (session 53)
  w4_gluon_mm.NARROW_DECODE = w4_gluon_mm.WIDE_DECODE = 2
  for m in (64, 128, 2048):
    for order, decode in ((1, 2), (0, 2), (1, 4), (1, 5)):
      w4_gluon_mm.DECODE = decode
      meta = w4_gluon_mm.meta_for(m, 3584, 37888, 28, decode_order=bool(order))
      text = sass(w4_gluon_mm.compile_for(meta, 90), f"mm_m{m}_do{order}_dv{decode}")
      start, body = min(mma_loops(text), key=lambda sb: len(sb[1]))  # the innermost: a pair of K steps
      total, side, ops = per_8_weights(body)
      print(f"large-M forward M={m} DECODE={decode} {'decode' if order else 'standard'} order: main loop at {start:#x}, "
            f"{len(body)} instructions; per 8 weights {total:.1f} ({side:.1f} decode-side); "
            f"{sorted(ops.items(), key=lambda x: -x[1])[:8]}")
  w4_gluon_mm.DECODE, w4_gluon_mm.NARROW_DECODE, w4_gluon_mm.WIDE_DECODE = saved
  for m in (8, 16, 32, 64):  # mma.sync at M <= 16, wgmma above (64: its narrow build)
    b = w4_gluon._build(m, 3584, 37888, 28, decode_order=True)
    ck = w4_gluon._compile_gluon(w4_gluon._kernel(b.wg, b.narrow_n), w4_gluon._ARG_DTYPES, b.meta, 90,
                                 num_warps=b.warps, maxnreg=b.maxnreg)
    body = instructions(sass(ck, f"gemv_m{m}"))
    total, side, ops = per_8_weights(body)
    print(f"decode GEMV M={m} decode order (whole build, unrolled): {len(body)} instructions; per 8 weights "
          f"{total:.1f} ({side:.1f} decode-side); {sorted(ops.items(), key=lambda x: -x[1])[:8]}")

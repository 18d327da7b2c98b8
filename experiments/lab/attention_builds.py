"""Lab (CPU, session 63): the Pallas decode attention (``decode_attention_append`` with the in-kernel merge) and the
Triton one of the PDL chain (``pallas_kernels.append_attention``) built side by side for sm_90, offline: registers
and spills (ptxas -v), shared memory, and counts of the instructions that shape their loops.

The Pallas kernel's Triton IR is captured from its lowering (``append_attention.pallas_ttir``) and compiled by
Triton with ``num_warps = 4`` and ``num_stages = 2``, as XLA compiles it. Needs Triton (the CPU wheel does) and its bundled ptxas.

  PYTHONPATH=$PWD python3 experiments/lab/attention_builds.py
"""
import os
import re
import subprocess
import tempfile

import triton

from pallas_kernels import append_attention as aa
from pallas_kernels import decode_attention as da
from pallas_kernels import w4_gluon

B, L, SLOTS, KH, HD, H = 8, 28, 2304, 4, 128, 28  # Qwen2.5-7B's heads, issue 6's batch-8 cache
N = (H + 2 * KH) * HD
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
COUNTED = ("mma.sync", "wgmma", "cp.async.cg", "ldmatrix", "bar.sync", "ex2.approx", "ld.global", "st.global")


def report(name: str, ptx: str, shared: int) -> None:
  with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(ptx)
  info = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                        text=True).stderr
  os.unlink(f.name)
  regs = re.search(r"Used (\d+) registers", info)
  spills = re.search(r"(\d+) bytes spill stores", info)
  counts = "  ".join(f"{k} {ptx.count(k)}" for k in COUNTED)
  print(f"{name:34s} registers {regs.group(1) if regs else '?':>4s}  spill stores {spills.group(1) if spills else '?'}"
        f"  shared {shared}  PTX lines {len(ptx.splitlines())}\n    {counts}", flush=True)


w4_gluon._target_cc = lambda: 90
w4_gluon._ffi_library = lambda: None  # (no GPU: build only)
built = aa.compile_ttir(aa.pallas_ttir(B, H, KH, SLOTS, HD, L, "bfloat16"), da.APPEND_WARPS, da.APPEND_STAGES)
report("Pallas decode_attention_append", built.asm["ptx"], built.metadata.shared)
for prefetch in (0, 1, 2):
  aa.PREFETCH, aa.STAGES = prefetch, 1 if prefetch == 1 else 2
  for gdc in (0, aa.GDC):
    mt = aa.meta(B, H, KH, SLOTS, HD, L, has_bias=True, bias_stacked=True, gdc=gdc)
    ptx, _, shared = aa.compiled(tuple(mt.items()), "*bf16", aa.WARPS, aa.STAGES)
    report(f"append_attention PREFETCH {prefetch} GDC {gdc}", ptx, shared)

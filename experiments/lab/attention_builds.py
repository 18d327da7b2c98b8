"""Lab (CPU, sessions 63-64): the Pallas decode attention (``decode_attention_append`` with the in-kernel merge) and
the Triton one of the PDL chain (``pallas_kernels.append_attention``) built side by side for sm_90 by this Triton,
offline: registers (cuobjdump -res-usage), shared memory, and SASS instruction counts in the main loop (from the first
to the last HMMA and on to the loop's branch) and after it (the partials' stores and the last program's merge).

The Pallas kernel's Triton IR is captured from its lowering (``append_attention.pallas_ttir``) and compiled with
``num_warps = 4`` and ``num_stages = 2``, as XLA compiles it. Session 64: XLA's own Triton builds that IR 28% faster
(393 against 549 µs for 28 layers on an H100, docs/benchmarks.md); the count after the loop is where Triton 3.6 differs
(shared-memory round trips for the merge's reductions), which ``append_attention``'s elementwise merge avoids. Needs Triton (the
CPU wheel does) and its bundled cuobjdump.

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
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
COUNTED = ("HMMA", "LDSM", "LDGSTS", "LDS", "STS", "SHFL", "BAR", "MUFU", "LDG", "STG")


def _tool(flag: str, cubin: bytes) -> str:
  with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
    f.write(cubin)
  try:
    return subprocess.run([CUOBJDUMP, flag, f.name], capture_output=True, text=True, check=True).stdout
  finally:
    os.unlink(f.name)


def report(name: str, compiled) -> None:
  """Prints the build's registers, shared bytes and SASS counts in and after its main loop."""
  cubin = compiled.asm["cubin"]
  regs = re.search(r"REG:(\d+)", _tool("-res-usage", cubin)).group(1)
  lines = [l for l in _tool("-sass", cubin).split("\n") if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
  ops = [re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?", "", l).split()[0].split(".")[0] for l in lines]
  mma = [i for i, o in enumerate(ops) if o == "HMMA"]
  end = next(i for i in range(mma[-1], len(ops)) if ops[i] == "BRA")
  regions = {"loop": ops[mma[0]:end + 1], "after": ops[end + 1:]}
  print(f"{name:40s} registers {regs:>4s}  shared {compiled.metadata.shared}  SASS {len(ops)}", flush=True)
  for region, part in regions.items():
    print(f"    {region:6s} {len(part):5d}  " + "  ".join(f"{k} {part.count(k)}" for k in COUNTED), flush=True)


w4_gluon._target_cc = lambda: 90
w4_gluon._ffi_library = lambda: None  # (no GPU: build only)
report("Pallas decode_attention_append", aa.compile_ttir(aa.pallas_ttir(B, H, KH, SLOTS, HD, L, "bfloat16"),
                                                         da.APPEND_WARPS, da.APPEND_STAGES))
mt = aa.meta(B, H, KH, SLOTS, HD, L, has_bias=True, bias_stacked=True, gdc=aa.GDC)
report("append_attention (PDL build)", w4_gluon._compile_gluon(aa._kernel(), aa.arg_dtypes("*bf16"), mt, 90,
                                                               num_warps=aa.WARPS, options={"num_stages": aa.STAGES},
                                                               gluon=False))

"""Lab (no GPU): compiles pallas_kernels.w4_gluon_dx's large-M dx kernel for sm_90 and prints the SASS
instruction mix, registers and shared memory.

  python3 experiments/lab/gluon/offline_dx.py
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pallas_kernels import w4_gluon, w4_gluon_dx
from sasstool import sass

if __name__ == "__main__":
    os.makedirs("/tmp/gl", exist_ok=True)
    for m, k, n, layers in [(2048, 18944, 3584, 28), (300, 3584, 4608, 1)]:
        b = w4_gluon_dx._build(m, k, n, layers)
        ck = w4_gluon._compile_gluon(w4_gluon_dx._kernel(), w4_gluon_dx._ARG_DTYPES, b.meta, 90, num_warps=8)
        print(f"M={m} K={k} N={n} L={layers}: grid {b.grid} {b.meta}")
        sass(ck, f"dx_m{m}_k{k}_n{n}")

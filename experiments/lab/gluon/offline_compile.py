"""Lab (no GPU): compiles pallas_kernels.w4_gluon's kernel for sm_90 as jax-triton would (the same
signature, constexprs and divisibility attributes) and prints the SASS instruction mix.

  python3 experiments/lab/gluon/offline_compile.py            # 7B gate/up at M = 8 and M = 16
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pallas_kernels import w4_gluon
from sasstool import sass

def compile_for(m, k, n, layers=1):
    """The build w4_gluon.forward would launch for x [m, k] (default settings), compiled for sm_90."""
    b = w4_gluon._build(m, k, n, layers)
    return w4_gluon._compile_gluon(w4_gluon._kernel(b.wg, b.narrow_n), w4_gluon._ARG_DTYPES, b.meta, 90,
                                   num_warps=b.warps, maxnreg=b.maxnreg), b.splits, b.meta

if __name__ == "__main__":
    os.makedirs("/tmp/gl", exist_ok=True)
    for m, k, n, layers in [(8, 3584, 37888, 28), (16, 3584, 4608, 1), (1, 18944, 3584, 28), (64, 3584, 37888, 28)]:
        ck, splits, meta = compile_for(m, k, n, layers)
        print(f"M={m} K={k} N={n} L={layers}: splits {splits} {meta}")
        sass(ck, f"lib_m{m}_k{k}_n{n}")

"""Lab: A/B device time of two versions of pallas_kernels/w4_triton.py in one process (GPU only).

  git show <commit>:pallas_kernels/w4_triton.py > .dev/lab/w4_old.py
  AB_OLD=.dev/lab/w4_old.py PYTHONPATH=$PWD python3 experiments/lab/ab_module.py

Each version's tuned forward, 7B shapes, M = 1, 8, 32: checked against the XLA reference on a
NaN-poisoned output, then the summed kernel device time per call (fused kernel + split-K sum) over a profiler
trace of calls on rotating weight copies. (The session-3 run used the median of the fused kernel
alone; the split-K sum is the same for both versions.)
"""
import importlib.util, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from labcommon import SHAPES_7B, activations, checked_error, rotating_weights, us_per_call
from pallas_kernels import w4_triton as new

spec = importlib.util.spec_from_file_location("w4_old", os.environ["AB_OLD"])
old = importlib.util.module_from_spec(spec); sys.modules["w4_old"] = old; spec.loader.exec_module(old)
tot = {"old": 0.0, "new": 0.0}
for name, (k, n) in SHAPES_7B.items():
  q0, qs = rotating_weights(k, n)
  for m in (1, 8, 32):
    x = activations(m, k)
    line = []
    for tag, mod in (("old", old), ("new", new)):
      err = checked_error(mod.forward, x, q0)
      us = us_per_call(mod.forward, x, qs)  # fused kernel + split-K sum
      tot[tag] += us
      line.append(f"{tag} {us:5.1f}us {(k * n * 9 / 16) / us / 1e3:5.0f}GB/s err {err:.1e}")
    print(f"{name:8s} M={m:2d}: " + " | ".join(line), flush=True)
print(f"summed: old {tot['old']:.1f}us new {tot['new']:.1f}us ({tot['new'] / tot['old'] - 1:+.1%})", flush=True)

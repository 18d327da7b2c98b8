"""Lab (GPU): experiments/bench_rollout.py with pallas_kernels.w4_gluon's module settings replaced,
for an A/B of a kernel or launcher setting in the rollout (the settings are read at trace time).

  GL_SET="NARROW_MIN_MB=128,NARROW_TARGET_PROGRAMS=512" PYTHONPATH=$PWD python3 experiments/lab/gluon/ab_rollout.py \
      --batches=8 --new_tokens=1024 --formats=nvfp4_fused

MODEL_SET="FUSED_DECODE_ATTENTION=0" replaces qerl_jax.models.decoder's module settings the same way
(also ACCUMULATE_DECODE=0, or ACCUMULATE_MAX_ROWS=64: a layer's projections in one buffer, session 15),
DA_SET="COMBINE_UNROLL_MAX=0" pallas_kernels.decode_attention's (session 21; APPEND_TARGET_PROGRAMS=1056 etc.,
session 23), RN_SET="WARPS=8,ZERO_CHUNK=8192" pallas_kernels.residual_norm's, and SAMPLING_SET="INVERSE_CDF=1"
qerl_jax.sampling's (session 29), MM_SET="MAX_SPLITS=8" pallas_kernels.w4_gluon_mm's (session 47: split-K in the
large-M forward, which a batch-256 decode step's M = 256 products may take), and MATMUL_SET="GLUON_MM_NARROW_MODEL=1"
pallas_kernels.matmul's (session 50: the model's linears on the narrow tiles at 32 < M <= 128), AA_SET="PREFETCH=2"
pallas_kernels.append_attention's (session 63) and DC_SET="GEMV_GDC=2" pallas_kernels.decode_chain's (the chain's
GEMVs without the early release).

GL_NO_ZERO=1 drops the launcher's memset of the atomic builds' output: the results are WRONG (they add
into whatever the buffer held); only for timing what the memsets cost in a rollout.
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # experiments/lab
from labcommon import set_module_settings  # noqa: E402
from pallas_kernels import append_attention, decode_attention, decode_chain, matmul, residual_norm, w4_gluon, w4_gluon_mm  # noqa: E402,E501
from qerl_jax import sampling  # noqa: E402
from qerl_jax.models import decoder  # noqa: E402

for env, module in (("GL_SET", w4_gluon), ("MODEL_SET", decoder), ("DA_SET", decode_attention),
                    ("RN_SET", residual_norm), ("SAMPLING_SET", sampling), ("MM_SET", w4_gluon_mm),
                    ("MATMUL_SET", matmul), ("AA_SET", append_attention), ("DC_SET", decode_chain)):
  set_module_settings(env, module)
if os.environ.get("GL_NO_ZERO") == "1":
  _attrs = w4_gluon._launch_attrs
  w4_gluon._launch_attrs = lambda *a, **k: _attrs(*a, **{**k, "zero_results": False})
  print("w4_gluon: no memset of the output (wrong results; timing only)", flush=True)
experiments = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, experiments)  # the script's sibling modules (devtime)
script = os.path.join(experiments, "bench_rollout.py")
sys.argv = [script] + sys.argv[1:]
runpy.run_path(script, run_name="__main__")

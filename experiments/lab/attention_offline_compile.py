"""Lab (no GPU): the decode-attention kernels compiled for sm_90 from their CPU lowering, with the
SASS instruction mix and register count (experiments/lab/gluon/sasstool.py).

Pallas' Triton lowering runs on the CPU (``lower(lowering_platforms=("cuda",))``); the Triton IR it
builds is captured and compiled by triton itself for sm_90 (``triton.compile`` of the ``.ttir``).
Session 14 found libdevice's sin/cos slow path in ``decode_attention_append`` this way.

  PYTHONPATH=$PWD python3 experiments/lab/attention_offline_compile.py      # Qwen2.5-7B heads, batch 8
  ATTN_BATCH=64 PYTHONPATH=$PWD python3 experiments/lab/attention_offline_compile.py
  ATTN_HEAD_DIM=16 ATTN_KV_HEADS=2 ATTN_GROUP=2 ...   # session 19: the score dots at head_dim 16 have K = 8
  ATTN_SYNC=1 ATTN_DYNAMIC=1 ...   # decode_attention_append with the splits merged in the kernel, dynamic chunks
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gluon"))
import jax
import jax.numpy as jnp
import triton
from jax._src.pallas.triton import pallas_call_registration as reg
from triton.backends.compiler import GPUTarget

from pallas_kernels import decode_attention as da
from sasstool import sass

captured = []
_lower = reg.lowering.lower_jaxpr_to_triton_module


def _capture(*args, **kwargs):
  result = _lower(*args, **kwargs)
  captured.append(result.module.operation.get_asm())
  return result


reg.lowering.lower_jaxpr_to_triton_module = _capture
if hasattr(reg, "gpu_info_lib"):  # jax >= 0.11 asks the GPU for its compute capability while lowering
  import types
  reg.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)

L, B, S = 28, int(os.environ.get("ATTN_BATCH", 8)), 2304
KH, G, D = (int(os.environ.get(k, v)) for k, v in (("ATTN_KV_HEADS", 4), ("ATTN_GROUP", 7), ("ATTN_HEAD_DIM", 128)))
da.APPEND_MIN_HEAD_DIM = 0  # compile below the library's minimum too (session 19: what head_dim 16 builds)
H, N = KH * G, (KH * G + 2 * KH) * D
sd = jax.ShapeDtypeStruct
i, cache, f32 = sd((), jnp.int32), sd((L, B, S, KH, D), jnp.bfloat16), jnp.float32
KERNELS = {
    "decode_attention": (lambda q, kc, vc, l, m, t: da.decode_attention(q, kc, vc, l, m, t, backend="pallas"),
                         sd((B, H, D), jnp.bfloat16), cache, cache, i, sd((B, S), jnp.int8), i),
    "decode_attention_append": (
        lambda y, bias, kc, vc, l, m, t, cos, sin, sync: da.decode_attention_append(
            y, bias, kc, vc, l, m, t, cos, sin, num_heads=H, backend="pallas",
            sync=sync if os.environ.get("ATTN_SYNC") == "1" else None,
            dynamic_chunks=os.environ.get("ATTN_DYNAMIC") == "1"),
        sd((B, N), f32), sd((N,), jnp.bfloat16), cache, cache, i, sd((B, S), jnp.int8), i,
        sd((B, D // 2), f32), sd((B, D // 2), f32), sd((B * KH,), jnp.int32)),
}
os.makedirs("/tmp/gl", exist_ok=True)
for name, (fn, *args) in KERNELS.items():
  del captured[:]
  jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  path = f"/tmp/gl/{name}_b{B}_d{D}.ttir"
  with open(path, "w") as f:
    f.write(captured[0])
  kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
  sass(kernel, f"{name}_b{B}_d{D}")

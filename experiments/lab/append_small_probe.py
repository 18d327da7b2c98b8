"""Lab (GPU, session 19): the fused decode-attention kernel (decode_attention_append, backend "pallas")
against its XLA reference at small head dims and groups, and tests/test_fuse.py's fused-adapter decode
test with the kernel replaced by the reference (which part of a GPU decode step departs)."""
import sys
import numpy as np
import jax.numpy as jnp
sys.path.insert(0, ".")
from pallas_kernels import decode_attention as da
import tests.test_decode_attention as tda
import tests.test_fuse as tf

for dim, group, kvh, length in [(16, 2, 2, 9), (16, 2, 2, 40), (32, 2, 2, 40), (64, 2, 2, 40), (32, 7, 2, 40), (128, 7, 4, 40)]:
  c, heads, _, _ = tda._append_case(0, dim=dim, group=group, kv_heads=kvh)
  c["slot_mask_BxS"] = c["slot_mask_BxS"].at[:, length - 1].set(True)
  o1, k1, v1 = da.decode_attention_append(**c, layer=1, length=length, num_heads=heads, backend="pallas")
  o2, k2, v2 = da.decode_attention_append(**c, layer=1, length=length, num_heads=heads, backend="reference")
  o1, o2 = (np.asarray(o, np.float32) for o in (o1, o2))
  print(f"dim {dim} group {group} kv {kvh} length {length}: out rel err {np.linalg.norm(o1 - o2) / np.linalg.norm(o2):.2e}, "
        f"k max diff {np.abs(np.asarray(k1, np.float32) - np.asarray(k2, np.float32)).max():.3g}", flush=True)


class MP:
  def setattr(self, obj, name, value):
    setattr(obj, name, value)


for mode in ("reference", "pallas"):
  real = da.auto_backend
  da.auto_backend = lambda dtype, mode=mode: mode if jnp.dtype(dtype).itemsize == 2 else "reference"
  try:
    tf.test_decode_reads_the_adapters_b_stack_in_place(MP(), True)
    print("test_fuse b_stack [True] with the attention backend", mode, "PASS", flush=True)
  except AssertionError as e:
    print("test_fuse b_stack [True] with the attention backend", mode, "FAIL", str(e)[:120], flush=True)
  da.auto_backend = real

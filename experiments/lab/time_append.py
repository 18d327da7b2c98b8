"""Lab (GPU): ``decode_attention_append`` at Qwen2.5-7B's heads, 28 layers unrolled in one jit, with
launch variants: wall time per call (median of repeated calls) and summed kernel time (devtime).
(XLA's bias + RoPE + cache updates around the plain kernel cannot be timed this way: outside the
decoder's scan carry XLA copies the cache; compare those in a rollout, ab_rollout.py MODEL_SET.)

  APPEND_BATCHES=8,64 APPEND_LENGTH=1300 PYTHONPATH=$PWD python3 experiments/lab/time_append.py
  APPEND_VARIANTS="append;merge;merge dyn" ...   # a subset (names as in VARIANTS; session 37: the in-kernel merge)
  APPEND_LENGTH=2,300,1300 ...                     # several fills (session 45: fixed cost against cost a slot)
  APPEND_VARIANTS="merge;tl" ...                   # session 63: the Triton kernel of the PDL chain, alone
  APPEND_CUBINS="p9=.lab/attn39.cubin" APPEND_VARIANTS="merge;pl;p9"  # session 64: the Pallas IR built offline
"""
import os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax, jax.numpy as jnp, numpy as np
import devtime
from pallas_kernels import decode_attention as da

L, S, KH, G, D = 28, 2304, 4, 7, 128
H = KH * G
N = (H + 2 * KH) * D
LENGTHS = [int(n) for n in os.environ.get("APPEND_LENGTH", "1300").split(",")]
length = LENGTHS[0]  # read by variant()'s calls at trace time; the loop below sets it
inv = jnp.asarray(1e6 ** -(np.arange(0, D, 2) / D), jnp.float32)


def variant(**kw):
  """A call ``(y, bias, kc, vc, li, mask8, cos, sin, sync) -> (o, kc, vc, sync)``; ``merge=True`` passes the carried
  ``sync`` (the splits merged in the kernel), else XLA combines them and ``sync`` passes through."""
  merge = kw.pop("merge", False)

  def call(y, bias, kc, vc, li, mask8, cos, sin, sync):
    out = da.decode_attention_append(y, bias, kc, vc, li, mask8, length, cos, sin, num_heads=H,
                                     sync=sync if merge else None, **kw)
    return out if merge else (*out, sync)
  return call


VARIANTS = {"append": variant(), "append t264": variant(target_programs=264),
            "append t1056": variant(target_programs=1056), "append t2112": variant(target_programs=2112),
            "merge": variant(merge=True), "merge dyn": variant(merge=True, dynamic_chunks=True),
            "merge dyn t1056": variant(merge=True, dynamic_chunks=True, target_programs=1056),
            "merge dyn t2112": variant(merge=True, dynamic_chunks=True, target_programs=2112),
            "merge s3": variant(merge=True, num_stages=3), "merge s4": variant(merge=True, num_stages=4),
            "merge b32": variant(merge=True, block_s=32), "merge b128": variant(merge=True, block_s=128),
            "merge w8": variant(merge=True, num_warps=8), "merge b128 w8": variant(merge=True, block_s=128, num_warps=8),
            "merge w2": variant(merge=True, num_warps=2),
            # session 51: batch 64 and 128 (never swept; 75.9 us a layer at 1280 slots in an H100 rollout profile)
            "merge t1056": variant(merge=True, target_programs=1056),
            "merge t2112": variant(merge=True, target_programs=2112),
            "merge t1056 s3": variant(merge=True, target_programs=1056, num_stages=3),
            "merge t2112 b32": variant(merge=True, target_programs=2112, block_s=32),
            "merge dyn t1056 s3": variant(merge=True, dynamic_chunks=True, target_programs=1056, num_stages=3)}


def tl_variant(**kw):
  """Session 63: the Triton kernel a PDL chain launches (pallas_kernels.append_attention), launched alone."""
  from pallas_kernels import append_attention as aa

  def call(y, bias, kc, vc, li, mask8, cos, sin, sync):
    return aa.attend_append(y, bias, kc, vc, li, mask8, length, cos, sin, num_heads=H, sync=sync, **kw)
  return call


def tl_set(**settings):
  """A tl variant with module settings of append_attention set for its trace."""
  from pallas_kernels import append_attention as aa
  inner = tl_variant()

  def call(*args):
    old = {name: getattr(aa, name) for name in settings}
    for name, value in settings.items():
      setattr(aa, name, value)
    try:
      return inner(*args)
    finally:
      for name, value in old.items():
        setattr(aa, name, value)
  return call


VARIANTS["tl"] = tl_variant()
VARIANTS["tl w8"] = tl_set(WARPS=8)
VARIANTS["tl b32"] = tl_set(BLOCK_S=32)
VARIANTS["tl t1056"] = tl_set(TARGET_PROGRAMS=1056)
VARIANTS["tl s3"] = tl_set(STAGES=3)
VARIANTS["tl p1"] = tl_set(PREFETCH=1, STAGES=1)  # the next block prefetched in registers (210 registers)
VARIANTS["tl p2"] = tl_set(PREFETCH=2)  # the first block's lines prefetched into the L2


def pallas_form(**settings):
  """Session 64: the Pallas kernel's own build (append_attention.FORM = "pallas"; with ``settings``, more of
  append_attention's attributes for the call) launched alone by the FFI launcher, against the same kernel launched by
  XLA ("merge"): it takes the bias as a stack."""
  inner = tl_set(FORM="pallas", **settings)

  def call(y, bias, *rest):
    return inner(y, jnp.broadcast_to(bias, (L,) + bias.shape), *rest)
  return call


VARIANTS["pl"] = pallas_form()


def cubin_form(path: str):
  """Session 64: a cubin of the Pallas attention's Triton IR built elsewhere (offline, by another Triton: its kernel
  ``decode_attention_append``, 38912 shared bytes as XLA launches it) launched by the FFI launcher with the "pl"
  variant's parameters: is it the build or the launch that makes "pl" slower than XLA's "merge"?"""
  import base64
  from pallas_kernels import w4_gluon
  build = []  # (loaded at the first call, on the GPU)

  def pallas_build(*args, **kwargs):
    if not build:
      text = "cubin:" + base64.b64encode(open(path, "rb").read()).decode("ascii")
      build.append(w4_gluon._preload(text, "decode_attention_append", 38912))
    return build[0]
  return pallas_form(pallas_build=pallas_build)


for _item in filter(None, os.environ.get("APPEND_CUBINS", "").split(",")):  # "name=path,..."
  VARIANTS[_item.split("=")[0]] = cubin_form(_item.split("=", 1)[1])
VARIANTS = {k: v for k, v in VARIANTS.items() if not os.environ.get("APPEND_VARIANTS")
            or k in os.environ["APPEND_VARIANTS"].split(";")}

for batch, length in [(int(b), n) for b in os.environ.get("APPEND_BATCHES", "8,64").split(",") for n in LENGTHS]:
  rng = np.random.default_rng(0)
  ys = jnp.asarray(rng.standard_normal((L, batch, N)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(N), jnp.bfloat16)
  mask8 = jnp.ones((batch, S), jnp.int8)
  pos = jnp.full((batch,), length + 7, jnp.int32)
  results, ref = {}, None
  for name, fn in VARIANTS.items():
    def run(kc, vc, ys=ys, fn=fn):
      acc = jnp.zeros((batch, H, D), jnp.float32)
      cos, sin = da.rope_cos_sin(pos, inv)  # once per step, as the decoder does
      sync = da.new_sync(batch, KH)  # once a step, carried through the layers
      for li in range(L):  # unrolled, as the decode step
        o, kc, vc, sync = fn(ys[li], bias, kc, vc, li, mask8, cos, sin, sync)
        acc = acc + o.astype(jnp.float32)
      return acc, kc, vc
    f = jax.jit(run, donate_argnums=(0, 1))
    # the same caches for every variant, drawn on the device (numpy's draw of 2 x 2.1G values took about 70 s a
    # variant at batch 64: session 51's sweep ran 3 of its 24 variants)
    kk, kv = jax.random.split(jax.random.key(1))
    kc = jax.random.normal(kk, (L, batch, S, KH, D), jnp.bfloat16)
    vc = jax.random.normal(kv, (L, batch, S, KH, D), jnp.bfloat16)
    acc, kc, vc = f(kc, vc)
    if ref is None:  # the first variant's output is the others' reference
      ref = np.asarray(acc)
    err = float(np.abs(np.asarray(acc) - ref).max() / np.abs(ref).max())
    state = [kc, vc]  # the caches are donated: each call takes the previous call's

    def call():
      out, state[0], state[1] = f(*state)
      return jax.block_until_ready(out)
    walls = []
    for _ in range(30):
      t0 = time.perf_counter()
      call()
      walls.append(time.perf_counter() - t0)
    durs = devtime.trace_durations(call)
    busy = sum(sum(v) for v in durs.values())
    results[name] = (np.median(walls) * 1e6, busy)
    print(f"batch {batch:3d} length {length:5d} {name:14s} err {err:.1e}  wall {np.median(walls)*1e6:7.1f} us  kernels {busy:7.1f} us "
          f"({sum(len(v) for v in durs.values())} kernels)", flush=True)

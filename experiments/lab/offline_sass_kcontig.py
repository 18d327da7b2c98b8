"""Lab (no GPU needed): SASS of a fused forward that reads K-contiguous packed codes ``[N, K/2]``.

The library stores NVFP4 codes as ``[K/2, N]`` (N contiguous); the MMA operand wants each thread's
bytes to be consecutive along K, so the kernel gathers them byte by byte from shared memory. This
lab kernel (same decode as ``w4_triton``'s asm path, no masks: shapes must divide the tiles) reads
the checkpoint's ``[N, K/2]`` layout instead, and prints the main loop's instruction mix with
``offline_sass.py``'s method (pip triton 3.6, sm_90). Column offsets are computed by
multiplication only (``step * (bk // 2)``): an integer division hides their divisibility from
Triton, whose loads then fall back to one address per element.

  python3 experiments/lab/offline_sass_kcontig.py
"""
import sys, os, functools, dataclasses
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import offline_sass as variant
from pallas_kernels import w4_triton as W

def decode_t(p, s, variant_):
  # p [bn, bkp] u8 (K contiguous), s [bn, bkp/8] f8
  bn, bkp = p.shape
  s = s.astype(jnp.float32).astype(jnp.bfloat16)
  s = jnp.broadcast_to(s[:, :, None], (bn, bkp // 8, 8)).reshape(bn, bkp)
  out = [plgpu.elementwise_inline_asm(asm, args=[p, s], constraints="=r,=r,r,r,r", pack=4,
         result_shape_dtypes=[jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)])[0] for asm in (W._E2M1_ASM_LO, W._E2M1_ASM_HI)]
  return out

def kernel(x_ref, p_ref, s_ref, o_ref, *, m, k, n, bm, bn, bk, steps, prefetch):
  pid_n, pid_s = pl.program_id(0), pl.program_id(1)
  n0 = pid_n * bn
  m_mask = jnp.arange(bm) < m
  def load(step):
    kb = step * bk
    x = plgpu.load(x_ref.at[pl.ds(0, bm), pl.ds(kb, bk)], mask=m_mask[:, None], other=0.0)
    xe, xo = lax.unstack(x.reshape(bm, bk // 2, 2), axis=2)
    p = plgpu.load(p_ref.at[pl.ds(n0, bn), pl.ds(step * (bk // 2), bk // 2)])
    s = plgpu.load(s_ref.at[pl.ds(n0, bn), pl.ds(step * (bk // 16), bk // 16)])
    return xe, xo, p, s
  def mult(acc, xe, xo, p, s):
    lo, hi = decode_t(p, s, None)
    acc += jnp.dot(xe, lo.T, preferred_element_type=jnp.float32)
    return acc + jnp.dot(xo, hi.T, preferred_element_type=jnp.float32)
  st0 = pid_s * steps
  if prefetch:
    def body(i, c):
      nxt = load(st0 + jnp.minimum(i + 1, steps - 1))
      return (mult(*c), *nxt)
    acc = lax.fori_loop(0, steps, body, (jnp.zeros((bm, bn), jnp.float32), *load(st0)))[0]
  else:
    acc = lax.fori_loop(0, steps, lambda i, a: mult(a, *load(st0 + i)), jnp.zeros((bm, bn), jnp.float32))
  plgpu.store(o_ref.at[pid_s, pl.ds(0, bm), pl.ds(n0, bn)], acc, mask=m_mask[:, None])

def build(m=8, k=3584, n=18944, bm=16, bn=128, bk=128, splits=4, warps=4, stages=3, prefetch=False):
  steps = k // bk // splits
  f = functools.partial(kernel, m=m, k=k, n=n, bm=bm, bn=bn, bk=bk, steps=steps, prefetch=prefetch)
  def call(x, pt, st):
    return pl.pallas_call(f, out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32), grid=(n // bn, splits),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))(x, pt, st)
  return call

if __name__ == "__main__":
  import subprocess, triton
  from triton.backends.compiler import GPUTarget
  for tag, kw in [("kt", {}), ("kt_pf", {"prefetch": True}), ("kt_bn64", {"bn": 64}), ("kt_bk64", {"bk": 64, "splits": 8})]:
    m, k, n = 8, 3584, 18944
    call = build(**kw)
    variant.captured.clear()
    jax.jit(call).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
                        jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn)).lower(lowering_platforms=("cuda",))
    path = f"{variant.OUT}/{tag}.ttir"; open(path, "w").write(variant.captured[-1])
    kk = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    open(f"{variant.OUT}/{tag}.ttgir", "w").write(kk.asm["ttgir"]); open(f"{variant.OUT}/{tag}.cubin", "wb").write(kk.asm["cubin"])
    sass = subprocess.check_output([variant.NV + "/cuobjdump", "-sass", f"{variant.OUT}/{tag}.cubin"]).decode()
    open(f"{variant.OUT}/{tag}.sass", "w").write(sass)
    nl, ops, tot = variant.loop_hist(sass)
    usage = subprocess.check_output([variant.NV + "/cuobjdump", "--dump-resource-usage", f"{variant.OUT}/{tag}.cubin"]).decode()
    print(usage.split("REG:")[1].split()[0], "regs")
    bn = kw.get("bn", 128); bk = kw.get("bk", 128)
    print(f"{tag}: loop {nl} = {nl / (bn * bk / 128):.2f}/value smem={kk.metadata.shared} {ops.most_common(10)}")

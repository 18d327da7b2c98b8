"""Lab: a split-K Pallas Triton kernel for the skinny LoRA product ``x @ A`` (see lora_xa.py)."""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(x_ref, a_ref, o_ref, *, m, k, r, bm, bk, br, steps):
  s, pm = pl.program_id(0), pl.program_id(1)
  m0 = pm * bm
  m_mask = (m0 + jnp.arange(bm)) < m
  r_mask = jnp.arange(br) < r
  acc = jnp.zeros((bm, br), jnp.float32)
  for i in range(steps):
    kb = (s * steps + i) * bk
    k_mask = (kb + jnp.arange(bk)) < k
    xt = plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(kb, bk)], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    at = plgpu.load(a_ref.at[pl.ds(kb, bk), pl.ds(0, br)], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
    acc += jnp.dot(xt, at, preferred_element_type=jnp.float32)
  plgpu.store(o_ref.at[s, pl.ds(m0, bm), pl.ds(0, br)], acc, mask=m_mask[:, None] & r_mask[None, :])


@functools.partial(jax.jit, static_argnames=("bk", "target_programs", "num_warps", "interpret"))
def pallas_xa(x, a, bk=64, target_programs=128, num_warps=4, interpret=False):
  m, k = x.shape
  r = a.shape[1]
  bm = max(16, min(64, pl.next_power_of_2(m)))
  br = max(16, pl.next_power_of_2(r))
  blocks = pl.cdiv(k, bk)
  steps = max(1, pl.cdiv(blocks, target_programs))
  splits = pl.cdiv(blocks, steps)
  part = pl.pallas_call(
      functools.partial(_kernel, m=m, k=k, r=r, bm=bm, bk=bk, br=br, steps=steps),
      out_shape=jax.ShapeDtypeStruct((splits, m, r), jnp.float32),
      grid=(splits, pl.cdiv(m, bm)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
  )(x, a)
  return part.sum(0)


def pallas_xa_bk128(x, a):
  return pallas_xa(x, a, bk=128)


def pallas_xa_p256(x, a):
  return pallas_xa(x, a, bk=64, target_programs=256)

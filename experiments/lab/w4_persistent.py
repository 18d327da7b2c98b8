"""Lab: a persistent, flattened small-M W4A16 forward (Pallas Triton), to test whether the library
kernel loses its time to pipeline fill and drain rather than to arithmetic.

Session 5 found the small-M kernel is not bound by instruction issue (19% fewer decode instructions
bought 2-3%). At M = 8 the tuned grid runs about 1056 programs of 8 K steps each, 4 resident per
SM: every program fills its load pipeline from scratch (an exposed HBM latency) and drains it before
its store. Here a fixed number of programs (about 4 per SM) each walk a list of (column tile, K split)
work items in one flattened loop over (item, K step), so the software pipeliner keeps prefetching
across item boundaries: the accumulator is reset at an item's first step and stored, masked, at its
last. Same decode (``w4_triton._decode_tile``), same split-K partial sums.

  PYTHONPATH=$PWD python3 experiments/lab/w4_persistent.py            # interpret-mode check (CPU)
  PYTHONPATH=$PWD PERSIST_TIME=1 python3 experiments/lab/w4_persistent.py   # GPU: check + device time
  (PERSIST_MS=8,32 and PERSIST_GRID=528x8,264x8, programs x splits, by default)

The GPU timing compares with the tuned ``w4_triton.forward`` at the 7B shapes (``labcommon``).
"""
import functools
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from pallas_kernels import w4_triton as W  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402


def _kernel(x_ref, p_ref, s_ref, gs_ref, idx_ref, o_ref, *, m, k, n, bm, bn, bk, splits, steps, items,
            programs, per_program, decode, fmt):
  pid = pl.program_id(0)
  prow, srow, igs = W._layer_rows(p_ref, gs_ref, idx_ref, k, fmt)
  asm = W._uses_asm(fmt, decode, x_ref.dtype)
  m_mask = jnp.arange(bm) < m
  n_tiles = -(-n // bn)

  # lax.div / lax.rem (all operands are non-negative): jnp's floor division and remainder lower
  # to sign fix-ups that Pallas' Triton lowering rejects inside a loop body.
  c = lambda v: jnp.int32(v)

  def body(i, acc):
    item = pid + lax.div(i, c(steps)) * c(programs)  # work items p, p + P, p + 2P, ...
    kstep = lax.rem(i, c(steps))
    valid = item < items
    tile, split = lax.rem(item, c(n_tiles)), lax.div(item, c(n_tiles))
    n0 = tile * bn
    n_mask = (n0 + jnp.arange(bn)) < n
    kb = (split * steps + kstep) * bk
    x_even, x_odd, p, s = W._fwd_load(x_ref, p_ref, s_ref, m0=0, bm=bm, m_mask=m_mask, n0=n0, bn=bn,
                                      n_mask=n_mask, kb=kb, bk=bk, k=k, fmt=fmt, split_x="registers",
                                      prow=prow, srow=srow, valid=valid, asm=asm)
    acc = jnp.where(kstep == 0, 0.0, acc)
    w_lo, w_hi = W._decode_tile(p, s, fmt, x_even.dtype, decode=decode)
    acc += jnp.dot(x_even, w_lo, preferred_element_type=jnp.float32)
    acc += jnp.dot(x_odd, w_hi, preferred_element_type=jnp.float32)
    out = acc * (igs * (W._ASM_GAIN if asm else 1.0))
    last = (kstep == steps - 1) & valid
    plgpu.store(o_ref.at[split, pl.ds(0, bm), pl.ds(n0, bn)], out,
                mask=m_mask[:, None] & n_mask[None, :] & last)
    return acc

  lax.fori_loop(0, per_program * steps, body, jnp.zeros((bm, bn), jnp.float32))


@functools.partial(jax.jit, static_argnames=("programs", "bn", "bk", "splits", "num_warps", "num_stages",
                                             "decode", "interpret"))
def forward(x, w, *, programs=528, bn=128, bk=64, splits=8, num_warps=4, num_stages=3, decode="asm",
            interpret=False):
  """``x @ W`` (float32 ``[M, N]``) for ``M <= 64`` bf16 rows, an NVFP4 ``[K, N]`` weight."""
  m, kx = x.shape
  k, n = w.shape
  assert kx == k and m <= 64, (x.shape, w.shape)
  fmt = W._format_of(w)
  if interpret:
    decode = "bits"
  bm = max(16, pl.next_power_of_2(m))
  total_steps = -(-k // bk)
  steps = -(-total_steps // splits)
  splits = -(-total_steps // steps)
  items = -(-n // bn) * splits
  programs = min(programs, items)
  per_program = -(-items // programs)
  kernel = functools.partial(_kernel, m=m, k=k, n=n, bm=bm, bn=bn, bk=bk, splits=splits, steps=steps,
                             items=items, programs=programs, per_program=per_program, decode=decode, fmt=fmt)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    parts = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32), grid=(programs,),
        interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="w4a16_persistent",
    )(x, *W._layer_operands(w, fmt, None))
  return parts.sum(0)


CASES = [(1, 160, 40, dict(bn=32, bk=32, splits=2, programs=3)),
         (8, 1040, 200, dict(bn=64, bk=64, splits=3, programs=4)),
         (17, 256, 72, dict(bn=32, bk=32, splits=1, programs=5)),
         (8, 3584, 4608, {}), (32, 18944, 3584, {})]


def _time():
  from labcommon import time_against_tuned
  ms = [int(v) for v in os.environ.get("PERSIST_MS", "8,32").split(",")]
  grid = [tuple(int(a) for a in v.split("x")) for v in os.environ.get("PERSIST_GRID", "528x8,264x8").split(",")]
  time_against_tuned({f"p{p}_s{s}": (lambda x, w, p=p, s=s: forward(x, w, programs=p, splits=s)) for p, s in grid},
                     ms)


if __name__ == "__main__":
  on_gpu = jax.default_backend() in ("gpu", "cuda")
  from labcommon import check_small_m_forward
  check_small_m_forward(forward, CASES, interpret=not on_gpu)
  if on_gpu and os.environ.get("PERSIST_TIME"):
    _time()

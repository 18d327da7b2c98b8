"""Decode attention that reads one layer of the stacked KV cache in place.

During decode (one new token per row) the decoder's layer ``scan`` used to slice
layer ``l`` out of the stacked cache ``[L, B, S, Hkv, hd]`` before XLA's
attention: a device copy of the whole layer's keys and values on every step,
plus a read of all ``S`` slots, written or not. This kernel takes the whole stack
and the layer index, and reads only the slots ``[0, length)`` that have been
written, in ``splits`` chunks per (row, KV head) with an online softmax (the
flash-decoding split of Dao et al., "Flash-Decoding for long-context inference",
2023); XLA combines the chunks' float32 partials.

``decode_attention`` picks the kernel on a GPU (``backend="auto"``) and the XLA
reference elsewhere; ``backend="interpret"`` runs the same kernel on the CPU
(tests).

``decode_attention_append`` is the whole decode step between the q/k/v projection and
attention in one kernel: it takes the projection's float32 output, adds the bias, rounds to
the compute dtype, applies RoPE to the new token's queries and key, writes its key and value
into the cache slot in place (an aliased output), and attends. Done by XLA, those steps were
about ten small kernels a layer (bias add, RoPE's angles and concatenates, the cache updates).
On an H200 (Qwen2.5-7B, NVFP4, 1024 new tokens) a decode step with CUDA graphs, as a rollout
runs, went from 2.65 to 2.57 ms at batch 8 and from 5.73 to 5.64 ms at batch 64
(docs/benchmarks_rollout.md, session 14). RoPE's cos and sin come in precomputed
(:func:`rope_cos_sin`, once per step): computing them per program brought libdevice's slow-path
range reduction into the kernel (2808 against 1432 SASS instructions), and the step then gained
only at batch 8.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASKED_SCORE = -1e30  # same finite fill as qerl_jax.models.layers.MASKED_SCORE
BACKENDS = ("auto", "reference", "pallas", "interpret")


MIN_HEAD_DIM = 16  # decode_attention's score dot contracts over hd; Triton's tl.dot needs K >= 16 for 16-bit inputs
# (Pallas does not check it: see APPEND_MIN_HEAD_DIM). Not seen failing; no model has hd < 64.
APPEND_MIN_HEAD_DIM = 32  # decode_attention_append's Triton kernel was wrong at head_dim 16 on an H200 (relative
# error 0.28-0.84 against the XLA reference; 2.6e-3 to 3.0e-3 at 32, 64 and 128: docs/benchmarks.md, session 19).
# The cause, seen offline in its Triton IR: the scores are two dots over the RoPE halves, 16x8 by 8x64 at
# head_dim 16 (K = 8), which Triton's own tl.dot refuses for 16-bit inputs (K >= 16, min_dot_size) but
# Pallas emits unchecked; decode_attention's one dot over hd = 16 is right.


def auto_backend(dtype) -> str:
  """What ``backend="auto"`` runs for queries of ``dtype``: ``"pallas"`` on a GPU for 16-bit
  queries, else ``"reference"`` (float32 stays on XLA: Triton's float32 dots are TF32)."""
  on_gpu = jax.default_backend() in ("gpu", "cuda")
  return "pallas" if on_gpu and jnp.dtype(dtype).itemsize == 2 else "reference"


def _resolve_backend(backend: str, dtype, head_dim: int, min_head_dim: int, name: str, why: str) -> str:
  """The backend an entry point runs: ``"auto"`` becomes :func:`auto_backend`'s pick, or the reference
  below the kernel's ``min_head_dim``; an explicit ``"pallas"`` there raises ValueError (``why``)."""
  if backend == "auto":
    backend = auto_backend(dtype) if head_dim >= min_head_dim else "reference"
  if backend == "pallas" and head_dim < min_head_dim:
    raise ValueError(f"{name}: the GPU kernel needs head_dim >= {min_head_dim}, got {head_dim} ({why}); "
                     f"use backend='reference' or 'auto'")
  return backend


def reference(q_BxHxD, k_LxBxSxKxD, v_LxBxSxKxD, layer, slot_mask_BxS, length):
  """XLA reference: slice layer ``layer``, mask slots ``>= length`` and unwritten ones, softmax in float32.

  Same arguments and result as :func:`decode_attention`.
  """
  b, h, d = q_BxHxD.shape
  kh = k_LxBxSxKxD.shape[3]
  s = k_LxBxSxKxD.shape[2]
  keys = lax.dynamic_index_in_dim(k_LxBxSxKxD, layer, 0, keepdims=False).astype(q_BxHxD.dtype)
  values = lax.dynamic_index_in_dim(v_LxBxSxKxD, layer, 0, keepdims=False).astype(q_BxHxD.dtype)
  q = q_BxHxD.reshape(b, kh, h // kh, d)
  scores = jnp.einsum("bkgd,bskd->bkgs", q, keys, preferred_element_type=jnp.float32) * (d ** -0.5)
  valid = slot_mask_BxS.astype(bool) & (jnp.arange(s) < length)[None, :]
  scores = jnp.where(valid[:, None, None, :], scores, MASKED_SCORE)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  out = jnp.einsum("bkgs,bskd->bkgd", probs, values, preferred_element_type=jnp.float32)
  return out.reshape(b, h, d).astype(q_BxHxD.dtype)


def _split_blocks(split, chunk, end, block_s):
  """``(first slot, end slot, blocks)`` of split ``split``: its fixed chunk of slots cut at ``end``."""
  s_begin = split * chunk
  s_end = jnp.minimum(s_begin + chunk, end)
  return s_begin, s_end, jnp.maximum(s_end - s_begin + block_s - 1, 0) // block_s


def _block_keep(mask_ref, b, s0, s_end, block_s):
  """``(inside, keep)`` ``[block_s]`` of the block at slot ``s0``: before ``s_end``, and also a real token."""
  inside = s0 + jnp.arange(block_s) < s_end
  return inside, (plgpu.load(mask_ref.at[b, pl.ds(s0, block_s)], mask=inside, other=0) != 0) & inside


def _online_softmax(m, l, acc, sc, keep, v):
  """One block of the online softmax (Milakov & Gimelshein 2018): running max ``m`` and sum ``l``
  ``[G]``, output ``acc [G, hd]`` (float32) updated with scores ``sc [G, block]`` (slots where
  ``keep`` is false left out) and values ``v [block, hd]``."""
  sc = jnp.where(keep[None, :], sc, MASKED_SCORE)
  m_new = jnp.maximum(m, jnp.max(sc, axis=1))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(keep[None, :], jnp.exp(sc - m_new[:, None]), 0.0)
  l = l * alpha + jnp.sum(p, axis=1)
  acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return m_new, l, acc


def _kernel(q_ref, k_ref, v_ref, mask_ref, layer_ref, length_ref, o_ref, m_ref, l_ref, *, batch, heads_kv,
            group, group_pad, slots, head_dim, block_s, chunk, num_layers):
  b, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  # The layer index and the length arrive as they are (no XLA op per call); clamped here.
  layer = jnp.minimum(jnp.maximum(layer_ref[0], 0), num_layers - 1)
  length = length_ref[0]
  # q folded to [B*Hkv*G, D]: this (row, KV head)'s G query heads, read as group_pad rows (tensor-core
  # dots need >= 16) with the rows past G masked to zero, so no padded copy of q is made.
  q = plgpu.load(q_ref.at[pl.ds((b * heads_kv + kvh) * group, group_pad), :],
                 mask=(jnp.arange(group_pad) < group)[:, None], other=0.0)  # [G_pad, D]
  g = group_pad
  # First row of (layer, b) in the cache folded to [L*B*S, Hkv*hd]: an int32 row index (below
  # 2**31 for any cache that fits a GPU); Pallas widens offsets to 64 bits for arrays over 4 GiB.
  row0 = (layer * batch + b) * slots
  col = pl.ds(kvh * head_dim, head_dim)
  s_begin, s_end, blocks = _split_blocks(split, chunk, length, block_s)
  scale = head_dim ** -0.5

  def body(i, carry):
    s0 = s_begin + i * block_s
    inside, keep = _block_keep(mask_ref, b, s0, s_end, block_s)
    k = plgpu.load(k_ref.at[pl.ds(row0 + s0, block_s), col], mask=inside[:, None], other=0.0).astype(q.dtype)
    v = plgpu.load(v_ref.at[pl.ds(row0 + s0, block_s), col], mask=inside[:, None], other=0.0).astype(q.dtype)
    sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    return _online_softmax(*carry, sc, keep, v)

  init = (jnp.full((g,), MASKED_SCORE, jnp.float32), jnp.zeros((g,), jnp.float32),
          jnp.zeros((g, head_dim), jnp.float32))
  m, l, acc = lax.fori_loop(0, blocks, body, init)
  o_ref[split, b, kvh] = acc
  m_ref[split, b, kvh] = m
  l_ref[split, b, kvh] = l


def _rope_rounded(x1, x2, cos, sin, dtype):
  """RoPE's "rotate half" on float32 halves holding ``dtype`` values, rounded like XLA's ``dtype``
  ops: ``[x1, x2] * cos + [-x2, x1] * sin`` with each product and the sum rounded to ``dtype``."""
  rnd = lambda a: _rounded(a, dtype)
  return rnd(rnd(x1 * cos) - rnd(x2 * sin)), rnd(rnd(x2 * cos) + rnd(x1 * sin))


def _rounded(a, dtype):
  """float32 ``a`` rounded to ``dtype``, kept in float32."""
  return a.astype(dtype).astype(jnp.float32)


def _append_kernel(qkv_ref, bias_ref, cos_ref, sin_ref, k_ref, v_ref, mask_ref, layer_ref, length_ref, *refs,
                   batch, heads, heads_kv, group, group_pad, slots, head_dim, block_s, chunk, nsplit, num_layers,
                   dtype, bias_stacked=False, dynamic_chunks=False, combine=False, interpret=False,
                   group_rows=16, merge_chunk=8):
  if combine:  # the sync counters come in (aliased) and go out; the combined output is one more output
    _, o_ref, m_ref, l_ref, k_out_ref, v_out_ref, out_ref, sync_ref = refs
  else:
    o_ref, m_ref, l_ref, k_out_ref, v_out_ref = refs
  b, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = jnp.minimum(jnp.maximum(layer_ref[0], 0), num_layers - 1)
  length = length_ref[0]
  write_at = length - 1  # this step's slot: attended from registers, written by split 0, never read
  half = head_dim // 2
  f32 = jnp.float32
  # The projection's output folded to [B * (H + 2 Hkv), hd]: one row per head (q heads, then k, then v);
  # the bias to [H + 2 Hkv, hd].
  rows = heads + 2 * heads_kv
  in_group = (jnp.arange(group_pad) < group)[:, None]
  q_at = lambda ref, r0, c0: plgpu.load(ref.at[pl.ds(r0, group_pad), pl.ds(c0, half)], mask=in_group, other=0.0)
  one_at = lambda ref, r, c0, n: plgpu.load(ref.at[pl.ds(r, 1), pl.ds(c0, n)]).astype(f32)
  rnd = lambda a: _rounded(a, dtype)  # the projection's output in the compute dtype
  br = layer * rows if bias_stacked else 0  # a stacked bias [L * (H + 2 Hkv), hd]: this layer's rows
  q1 = rnd(q_at(qkv_ref, b * rows + kvh * group, 0) + q_at(bias_ref, br + kvh * group, 0))
  q2 = rnd(q_at(qkv_ref, b * rows + kvh * group, half) + q_at(bias_ref, br + kvh * group, half))
  kr, vr = heads + kvh, heads + heads_kv + kvh
  k1 = rnd(one_at(qkv_ref, b * rows + kr, 0, half) + one_at(bias_ref, br + kr, 0, half))
  k2 = rnd(one_at(qkv_ref, b * rows + kr, half, half) + one_at(bias_ref, br + kr, half, half))
  v_new = rnd(one_at(qkv_ref, b * rows + vr, 0, head_dim) + one_at(bias_ref, br + vr, 0, head_dim))  # [1, hd]
  # This row's RoPE cos and sin (float32, made once per decode step by rope_cos_sin), in the compute dtype.
  cos, sin = rnd(one_at(cos_ref, b, 0, half)), rnd(one_at(sin_ref, b, 0, half))  # [1, hd/2]
  q1, q2 = _rope_rounded(q1, q2, cos, sin, dtype)
  k1, k2 = _rope_rounded(k1, k2, cos, sin, dtype)

  row0 = (layer * batch + b) * slots
  col = kvh * head_dim

  @pl.when(split == 0)
  def _():
    row = pl.ds(row0 + write_at, 1)
    plgpu.store(k_out_ref.at[row, pl.ds(col, half)], k1.astype(k_out_ref.dtype))
    plgpu.store(k_out_ref.at[row, pl.ds(col + half, half)], k2.astype(k_out_ref.dtype))
    plgpu.store(v_out_ref.at[row, pl.ds(col, head_dim)], v_new.astype(v_out_ref.dtype))

  scale = head_dim ** -0.5
  # The new token opens split 0's online softmax (when its slot is attended at all).
  new_kept = (plgpu.load(mask_ref.at[b, pl.ds(write_at, 1)]) != 0) & (split == 0)  # [1]
  sc_new = (jnp.sum(q1 * k1, axis=1) + jnp.sum(q2 * k2, axis=1)) * scale  # [G_pad]
  m = jnp.where(new_kept, sc_new, MASKED_SCORE)
  l = jnp.where(new_kept, 1.0, 0.0) + jnp.zeros((group_pad,), f32)
  acc = jnp.where(new_kept[:, None], v_new, 0.0) + jnp.zeros((group_pad, head_dim), f32)
  q1, q2 = q1.astype(dtype), q2.astype(dtype)

  if dynamic_chunks:  # the written slots [0, write_at) dealt evenly (in whole blocks) over the nsplit programs
    chunk = jnp.maximum(pl.cdiv(pl.cdiv(write_at, block_s), nsplit), 1) * block_s
  s_begin, s_end, blocks = _split_blocks(split, chunk, write_at, block_s)

  def body(i, carry):
    s0 = s_begin + i * block_s
    inside, keep = _block_keep(mask_ref, b, s0, s_end, block_s)
    rows_s = pl.ds(row0 + s0, block_s)
    ld = lambda ref, c0, n: plgpu.load(ref.at[rows_s, pl.ds(c0, n)], mask=inside[:, None], other=0.0).astype(dtype)
    dims = (((1,), (1,)), ((), ()))
    sc = (lax.dot_general(q1, ld(k_ref, col, half), dims, preferred_element_type=f32)
          + lax.dot_general(q2, ld(k_ref, col + half, half), dims, preferred_element_type=f32)) * scale
    return _online_softmax(*carry, sc, keep, ld(v_ref, col, head_dim))

  m, l, acc = lax.fori_loop(0, blocks, body, (m, l, acc))
  if not combine:  # XLA's combine reads every split's partials
    o_ref[split, b, kvh] = acc
    m_ref[split, b, kvh] = m
    l_ref[split, b, kvh] = l
  else:  # the merge below reads the active splits' rows of real query heads only
    active = jnp.maximum(pl.cdiv(write_at, chunk), 1)  # the splits that saw a slot (split 0 holds the new token's)

    @pl.when(split < active)
    def _():
      plgpu.store(o_ref.at[split, b, kvh], acc, mask=in_group)
      m_ref[split, b, kvh] = m
      l_ref[split, b, kvh] = l

    # The last of this (row, KV head)'s nsplit programs to finish merges their partials: the split-K "last
    # block" pattern (as CUTLASS's semaphore: every thread's stores, a block barrier, then one release/acquire
    # atomic). It resets the counter, so the counters are zero again when the kernel ends.
    if not interpret:  # (no barrier in interpret mode, where programs run one after another)
      plgpu.debug_barrier()
    pair = b * heads_kv + kvh
    arrived = plgpu.atomic_add(sync_ref, pair, jnp.ones((), jnp.int32))  # acq_rel at GPU scope

    @pl.when(arrived == nsplit - 1)
    def _():
      # The partials come in chunks of `merge_chunk` splits, each chunk's m, l and o as one masked load (a loop of
      # one split a step waited on the L2 twice a split in the offline SASS), merged online (running max, rescaled
      # sums; Milakov & Gimelshein 2018). Plain loads: the acquire orders them after the
      # other programs' stores (on sm_90 the atomic is followed by an L1 invalidate, CCTL.IVALL, and a barrier).
      rows = jnp.arange(group_rows) < group

      def merge(c, carry):  # chunk c of merge_chunk splits, merged into the running (max, sum, output)
        top, den, num = carry
        c0 = c * merge_chunk
        live = (c0 + jnp.arange(merge_chunk) < active)[:, None] & rows[None, :]  # [ch, rows]
        at = lambda ref: ref.at[pl.ds(c0, merge_chunk), b, kvh, pl.ds(0, group_rows)]
        mc = plgpu.load(at(m_ref), mask=live, other=-jnp.inf)
        lc = plgpu.load(at(l_ref), mask=live, other=0.0)
        oc = plgpu.load(at(o_ref), mask=live[:, :, None], other=0.0)  # [ch, rows, hd]
        new_top = jnp.maximum(top, jnp.max(mc, axis=0))
        rescale = jnp.exp(top - new_top)  # 0 before the first chunk (split 0 is always active)
        w = jnp.exp(mc - new_top[None, :])  # 0 where not live
        return (new_top, den * rescale + jnp.sum(w * lc, axis=0),
                num * rescale[:, None] + jnp.sum(w[:, :, None] * oc, axis=0))

      init = (jnp.full((group_rows,), -jnp.inf, f32), jnp.zeros((group_rows,), f32),
              jnp.zeros((group_rows, head_dim), f32))
      # only the chunks holding active splits: one at most 8 active splits (a batch-8 7B step up to 1536 slots)
      _, den, num = lax.fori_loop(0, pl.cdiv(active, merge_chunk), merge, init)
      out = num / jnp.where(den > 0, den, 1.0)[:, None]
      plgpu.store(out_ref.at[pl.ds((b * heads_kv + kvh) * group, group_rows), :], out.astype(out_ref.dtype),
                  mask=rows[:, None])
      plgpu.store(sync_ref.at[pl.ds(pair, 1)], jnp.zeros((1,), jnp.int32))


def _choose_splits(batch: int, heads_kv: int, slots: int, block_s: int, target_programs: int) -> int:
  return int(max(1, min(-(-slots // block_s), -(-target_programs // (batch * heads_kv)))))


def _check_cache_args(k_LxBxSxKxD, v_LxBxSxKxD, slot_mask_BxS, backend, block_s) -> tuple:
  """The checks both entry points share; returns the cache shape ``(L, B, S, Hkv, hd)``."""
  if backend not in BACKENDS:
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
  if k_LxBxSxKxD.ndim != 5 or v_LxBxSxKxD.shape != k_LxBxSxKxD.shape:
    raise ValueError(f"k and v caches must both be [L, B, S, Hkv, hd]; got {k_LxBxSxKxD.shape} and "
                     f"{v_LxBxSxKxD.shape}")
  _, b, s, _, _ = k_LxBxSxKxD.shape
  if slot_mask_BxS.shape != (b, s):
    raise ValueError(f"slot_mask must be [B={b}, S={s}]; got {slot_mask_BxS.shape}")
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"block_s must be a power of 2 >= 16, got {block_s}")
  return k_LxBxSxKxD.shape


def _check_scalars(name: str, layer, length) -> None:
  """``layer`` and ``length`` must each be one value (a scalar, traced or not, or a one-element array):
  a per-row ``length`` ``[B]`` is not taken (the slot mask marks each row's padding)."""
  for arg, value in (("layer", layer), ("length", length)):
    if jnp.size(value) != 1:
      raise ValueError(f"{name}: {arg} must be an int32 scalar; got shape {jnp.shape(value)}")


def _pow2(n: int) -> int:
  """The least power of 2 >= ``n`` (1 for ``n <= 1``)."""
  return 1 << max(n - 1, 0).bit_length()


def _geometry(batch, heads, heads_kv, slots, block_s, splits, target_programs) -> tuple:
  """``(G, G padded to a tensor-core tile of >= 16 rows, block_s, splits, chunk)`` of a launch."""
  g = heads // heads_kv
  g_pad = max(16, _pow2(g))
  block_s = min(block_s, max(16, _pow2(slots)))
  nsplit, chunk = _splits_and_chunk(batch, heads_kv, slots, block_s, splits, target_programs)
  return g, g_pad, block_s, nsplit, chunk


def _splits_and_chunk(batch, heads_kv, slots, block_s, splits, target_programs) -> tuple[int, int]:
  """(programs per (row, KV head), slots per program: a fixed chunk of whole blocks of the cache).

  Chunks are fixed by the cache size, not by the traced fill: a chunk past ``length`` does no work.
  (Dividing the filled slots evenly at run time was measured slower on an H200: more partials to
  combine, 2.68 against 2.61 ms a batch-8 7B decode step; docs/benchmarks_rollout.md, session 14.)"""
  nsplit = splits or _choose_splits(batch, heads_kv, slots, block_s, target_programs)
  chunk = -(-(-(-slots // nsplit)) // block_s) * block_s
  return -(-slots // chunk), chunk


def decode_attention(q_BxHxD: jax.Array, k_LxBxSxKxD: jax.Array, v_LxBxSxKxD: jax.Array, layer,
                     slot_mask_BxS: jax.Array, length, *, backend: str = "auto", block_s: int = 64,
                     splits: int | None = None, target_programs: int = 528, num_warps: int = 4,
                     num_stages: int = 2) -> jax.Array:
  """One query token per row against layer ``layer`` of a stacked KV cache, read in place.

  Grouped-query softmax attention (Ainslie et al. 2023) with scale ``1/sqrt(hd)``
  and float32 scores and softmax, over the slots ``s < length`` whose
  ``slot_mask`` is set; slots at and after ``length`` are never read.

  Args:
    q_BxHxD: queries, bf16 (or float16/float32) ``[B, H, hd]`` with ``H = Hkv * G``
      (query head ``h`` uses KV head ``h // G``).
    k_LxBxSxKxD, v_LxBxSxKxD: the stacked cache ``[L, B, S, Hkv, hd]`` (any float dtype;
      cast to q's dtype for the products).
    layer: int32 scalar (may be traced), the layer to read; clamped to ``[0, L)``.
    slot_mask_BxS: bool/int ``[B, S]``, nonzero at slots holding a real token
      (left padding and unwritten slots are 0). The kernel reads int8: pass
      int8 to skip a conversion per call (the decoder converts once per step).
    length: int32 scalar (may be traced), the number of slots written so far,
      including this step's token: slots ``[0, length)`` are attended.
    backend: ``"auto"`` (the Pallas kernel on a GPU for bf16/float16 queries,
      else the reference),
      ``"reference"``, ``"pallas"``, or ``"interpret"`` (the kernel in Pallas
      interpret mode; CPU tests).
    block_s: slots per inner step (a power of 2, at least 16).
    splits: chunks of the slot axis per (row, KV head), each its own program
      (default: enough for about ``target_programs`` programs).
    num_warps, num_stages: Triton launch parameters.

  Returns:
    ``[B, H, hd]`` in q's dtype. Every row must have at least one attended slot
    (true in decode: the current token's own slot); a row with none gets zeros
    from the kernel, where the reference averages all values.

  Raises:
    ValueError: inconsistent shapes, ``H`` not a multiple of ``Hkv``, a ``layer`` or ``length`` that is
      not one value, a bad ``block_s``, an unknown backend, or ``backend="pallas"`` with
      ``hd < MIN_HEAD_DIM`` (``"auto"`` runs the reference there).
  """
  num_layers, b, s, kh, d = _check_cache_args(k_LxBxSxKxD, v_LxBxSxKxD, slot_mask_BxS, backend, block_s)
  if q_BxHxD.ndim != 3 or q_BxHxD.shape[0] != b or q_BxHxD.shape[2] != d:
    raise ValueError(f"q must be [B={b}, H, hd={d}]; got {q_BxHxD.shape}")
  h = q_BxHxD.shape[1]
  if h % kh:
    raise ValueError(f"{h} query heads are not a multiple of {kh} KV heads")
  _check_scalars("decode_attention", layer, length)
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  length = jnp.asarray(length, jnp.int32).reshape(1)
  backend = _resolve_backend(backend, q_BxHxD.dtype, d, MIN_HEAD_DIM, "decode_attention",
                             "a 16-bit tensor-core dot contracts at least 16")
  if backend == "reference":
    return reference(q_BxHxD, k_LxBxSxKxD, v_LxBxSxKxD, jnp.clip(layer[0], 0, num_layers - 1), slot_mask_BxS,
                     length[0])

  g, g_pad, block_s, nsplit, chunk = _geometry(b, h, kh, s, block_s, splits, target_programs)
  kernel = functools.partial(_kernel, batch=b, heads_kv=kh, group=g, group_pad=g_pad, slots=s, head_dim=d,
                             block_s=block_s, chunk=chunk, num_layers=num_layers)
  out_shape = (jax.ShapeDtypeStruct((nsplit, b, kh, g_pad, d), jnp.float32),
               jax.ShapeDtypeStruct((nsplit, b, kh, g_pad), jnp.float32),
               jax.ShapeDtypeStruct((nsplit, b, kh, g_pad), jnp.float32))
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    o, m, l = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(b, kh, nsplit), interpret=backend == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="decode_attention",
    )(q_BxHxD.reshape(b * h, d), k_LxBxSxKxD.reshape(num_layers * b * s, kh * d),
      v_LxBxSxKxD.reshape(num_layers * b * s, kh * d), slot_mask_BxS.astype(jnp.int8), layer, length)
  return _combine(o, m, l, g, q_BxHxD.dtype)


COMBINE_UNROLL_MAX = 32  # up to this many splits, _combine is written elementwise over the splits (one XLA kernel)


def _combine(o, m, l, group, dtype):
  """The splits' float32 partials ``o [n, B, Hkv, G_pad, hd]``, ``m``/``l`` ``[n, B, Hkv, G_pad]``
  -> ``[B, H, hd]`` in ``dtype``: weights ``exp(m_i - max_i m_i)`` (the online softmax's merge, Milakov &
  Gimelshein 2018); empty splits have ``l = 0``.

  Up to :data:`COMBINE_UNROLL_MAX` splits the max and the sums are unrolled over the split axis: elementwise
  code that XLA runs as one kernel, where reductions over that axis ran as two (a max-and-exp kernel, then
  the sums; 1.2 + 1.5 µs a layer in a batch-8 decode step on an H200)."""
  n, b, kh, _, d = o.shape
  o, m, l = o[:, :, :, :group], m[:, :, :, :group], l[:, :, :, :group]
  if n <= COMBINE_UNROLL_MAX:
    top = m[0]
    for i in range(1, n):
      top = jnp.maximum(top, m[i])
    w = [jnp.exp(m[i] - top) for i in range(n)]
    den = sum(w[i] * l[i] for i in range(n))
    num = sum(w[i][..., None] * o[i] for i in range(n))
  else:
    w = jnp.exp(m - jnp.max(m, axis=0)[None])
    den = jnp.sum(w * l, axis=0)
    num = jnp.sum(w[..., None] * o, axis=0)
  out = num / jnp.where(den > 0, den, 1.0)[..., None]
  return out.reshape(b, kh * group, d).astype(dtype)


def _split_qkv(qkv_BxN, bias_N, heads, heads_kv, head_dim, dtype):
  """float32 ``[B, (H + 2 Hkv) hd]`` (+ bias) -> q ``[B, H, hd]``, k and v ``[B, Hkv, hd]`` in ``dtype``."""
  b = qkv_BxN.shape[0]
  y = qkv_BxN.astype(jnp.float32)
  if bias_N is not None:
    y = y + bias_N.astype(jnp.float32)
  y = y.astype(dtype).reshape(b, heads + 2 * heads_kv, head_dim)
  return y[:, :heads], y[:, heads:heads + heads_kv], y[:, heads + heads_kv:]


def rope_cos_sin(positions_B: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """RoPE's ``(cos, sin)`` of each row's angles ``position * inv_freq``, float32 ``[B, hd / 2]``.

  The operands of :func:`decode_attention_append`'s RoPE, made once per decode step (every layer
  uses the same positions), in float32 as :func:`qerl_jax.models.layers.rope` makes them.

  Args:
    positions_B: int32 ``[B]``, the new token's position per row.
    inv_freq: float32 ``[hd / 2]`` (:func:`qerl_jax.models.config.rope_inv_freq`).
  """
  ang = positions_B.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)[None, :]
  return jnp.cos(ang), jnp.sin(ang)


def _rope_reference(x_BxNxD, cos_BxR, sin_BxR):
  """:func:`qerl_jax.models.layers.apply_rope` for one token per row."""
  from qerl_jax.models import layers  # here, not at the top: the decoder imports this module
  return layers.apply_rope(x_BxNxD[:, None], cos_BxR[:, None], sin_BxR[:, None])[:, 0]


def reference_append(qkv_BxN, bias_N, k_LxBxSxKxD, v_LxBxSxKxD, layer, slot_mask_BxS, length, cos_BxR, sin_BxR,
                     *, num_heads, dtype):
  """XLA reference of :func:`decode_attention_append` (same arguments and results): the decoder's
  ops (RoPE as :func:`qerl_jax.models.layers.rope`, a dynamic-update-slice per cache, :func:`reference`)."""
  num_layers, b, s, kh, d = k_LxBxSxKxD.shape
  layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1)
  n = (num_heads + 2 * kh) * d
  if qkv_BxN.ndim == 1:  # the head of a buffer
    qkv_BxN = qkv_BxN[:b * n].reshape(b, n)
  if bias_N is not None and bias_N.ndim == 2:  # a stack: this layer's
    bias_N = lax.dynamic_index_in_dim(bias_N, layer, 0, keepdims=False)
  q, k, v = _split_qkv(qkv_BxN, bias_N, num_heads, kh, d, dtype)
  q, k = _rope_reference(q, cos_BxR, sin_BxR), _rope_reference(k, cos_BxR, sin_BxR)
  at = (layer, 0, jnp.asarray(length, jnp.int32) - 1, 0, 0)
  k_LxBxSxKxD = lax.dynamic_update_slice(k_LxBxSxKxD, k[None, :, None].astype(k_LxBxSxKxD.dtype), at)
  v_LxBxSxKxD = lax.dynamic_update_slice(v_LxBxSxKxD, v[None, :, None].astype(v_LxBxSxKxD.dtype), at)
  out = reference(q, k_LxBxSxKxD, v_LxBxSxKxD, layer, slot_mask_BxS, length)
  return out, k_LxBxSxKxD, v_LxBxSxKxD


# decode_attention_append's launch defaults (read at trace time; module settings so that a rollout A/B can set
# them: experiments/lab/gluon/ab_rollout.py DA_SET=...). Session 23's sweep (H200, 7B shape, NVFP4, batch 8,
# 2048 new tokens: 12 splits of 3 blocks; docs/benchmarks.md) found these best: a step took 2.28 ms, against
# 2.30 with 9 splits of 4 blocks (target 264), 2.40 with 5 (132), 2.34-2.35 with 18 (1056), 2.44 with 36 (2112),
# 2.29 with blocks of 128, 2.32 with 8 warps, 2.28 with 3 stages.
APPEND_BLOCK_S = 64
APPEND_TARGET_PROGRAMS = 528
APPEND_WARPS = 4
APPEND_STAGES = 2
# Chunks of the slot axis per program: False fixes them by the cache size (a chunk past the filled length does no
# work; session 14's choice), True deals the filled slots evenly over the same number of programs at run time.
# Session 39 (H200, batch 8, 1300 slots, with the in-kernel merge): 369.8 µs for 28 layers against 361.1 fixed, and
# no faster in a rollout (2.143 against 2.144 ms a step), so it stays off.
APPEND_DYNAMIC_CHUNKS = False
# With ``sync``, the merging program loads this many splits' partials at once, one chunk a step over the chunks that
# hold active splits. Offline sm_90 (7B heads, batch 8): 8 makes the kernel 152 registers (without sync 96), 4 makes
# it 128; the batch-8 step has at most 12 splits, 7 active at the rollout's mean length.
MERGE_CHUNK = 8


def new_sync(batch: int, heads_kv: int) -> jax.Array:
  """The zeroed counters :func:`decode_attention_append` takes as ``sync``: int32 ``[batch * heads_kv]``.

  The kernel leaves them zero again, so one array, carried from call to call (it is an aliased output),
  serves every layer of a decode step."""
  return jnp.zeros((batch * heads_kv,), jnp.int32)


def decode_attention_append(qkv_BxN: jax.Array, bias_N, k_LxBxSxKxD: jax.Array, v_LxBxSxKxD: jax.Array, layer,
                            slot_mask_BxS: jax.Array, length, cos_BxR: jax.Array, sin_BxR: jax.Array, *,
                            num_heads: int, dtype=jnp.bfloat16, backend: str = "auto", block_s: int | None = None,
                            splits: int | None = None, target_programs: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            sync: jax.Array | None = None, dynamic_chunks: bool | None = None):
  """A decode step's attention from the q/k/v projection's float32 output, appending to the cache in place.

  In one kernel: ``y = qkv + bias`` (float32) rounded to ``dtype`` and split into
  q ``[B, H, hd]``, k and v ``[B, Hkv, hd]`` (heads in that order, as the fused q/k/v weight
  of :func:`qerl_jax.models.fuse_projections`); RoPE (Su et al. 2021, "rotate half", as
  :func:`qerl_jax.models.layers.rope`) on q and k with the given cos and sin; k and v written to slot
  ``length - 1`` of layer ``layer`` of the stacked cache (in place: the caches are aliased
  outputs, as a dynamic-update-slice of the carried cache would be); then the grouped-query
  attention of :func:`decode_attention` over slots ``[0, length)``, the new token's own
  slot taken from registers.

  Args:
    qkv_BxN: float32 ``[B, (H + 2 Hkv) * hd]``: ``x @ [Wq | Wk | Wv]`` (any adapter delta included);
      or a 1-D float32 buffer (a multiple of ``hd`` long) whose first ``B * (H + 2 Hkv) * hd``
      elements hold it row-major, such as a decode step's
      :class:`qerl_jax.models.layers.Accumulator`: the kernel reads them in place, where
      slicing them out would be a device copy (XLA materializes a slice that feeds a custom call).
    bias_N: ``[(H + 2 Hkv) * hd]`` (any float dtype), or a stack ``[L, (H + 2 Hkv) * hd]`` of
      which the kernel reads layer ``layer`` in place (for the same reason), or None.
    k_LxBxSxKxD, v_LxBxSxKxD: the stacked cache ``[L, B, S, Hkv, hd]`` (any float dtype).
    layer: int32 scalar (may be traced), clamped to ``[0, L)``.
    slot_mask_BxS: bool/int ``[B, S]``, nonzero at slots holding a real token, this step's
      slot ``length - 1`` included (int8 skips a conversion).
    length: int32 scalar (may be traced), slots written after this step (``1 <= length <= S``).
    cos_BxR, sin_BxR: float32 ``[B, hd / 2]``, RoPE's cos and sin at each row's new position
      (:func:`rope_cos_sin`: the same for every layer of a step, so made once per step).
    num_heads: ``H``, a multiple of ``Hkv``.
    dtype: the compute dtype q, k and v are rounded to (the model's).
    backend, block_s, splits, target_programs, num_warps, num_stages: as :func:`decode_attention`;
      ``"auto"`` runs the kernel on a GPU for a 16-bit ``dtype``. None takes the module's
      :data:`APPEND_BLOCK_S`, :data:`APPEND_TARGET_PROGRAMS`, :data:`APPEND_WARPS`, :data:`APPEND_STAGES`.
    sync: None, or int32 ``[B * Hkv]`` zeros (:func:`new_sync`): then the kernel also merges the splits'
      partials itself (the last program of each (row, KV head) to finish does it, counted on ``sync``) instead
      of a separate XLA kernel after it, leaves ``sync`` zero again and returns it as a fourth result, to pass
      to the next call (it is an aliased output, so a carried one costs no copy). The reference ignores it.
    dynamic_chunks: deal the filled slots evenly over the programs at run time (None takes
      :data:`APPEND_DYNAMIC_CHUNKS`; the default fixes each program's chunk by the cache size).

  Returns:
    ``(out [B, H, hd] in dtype, k cache, v cache)``, the caches with slot ``length - 1`` of
    layer ``layer`` written; with ``sync``, ``(out, k cache, v cache, sync)``. The kernel's RoPE rounds each
    product and the sum to ``dtype``, as XLA's ``dtype`` arithmetic in :func:`qerl_jax.models.layers.rope`.

  Raises:
    ValueError: inconsistent shapes, an odd ``hd``, ``H`` not a multiple of ``Hkv``, a ``layer`` or
      ``length`` that is not one value, a bad ``block_s``, a ``sync`` that is not int32 ``[B * Hkv]``, an
      unknown backend, or ``backend="pallas"`` with ``hd < APPEND_MIN_HEAD_DIM`` (``"auto"`` runs the
      reference there).
  """
  block_s = APPEND_BLOCK_S if block_s is None else block_s
  target_programs = APPEND_TARGET_PROGRAMS if target_programs is None else target_programs
  num_warps = APPEND_WARPS if num_warps is None else num_warps
  num_stages = APPEND_STAGES if num_stages is None else num_stages
  dynamic_chunks = APPEND_DYNAMIC_CHUNKS if dynamic_chunks is None else dynamic_chunks
  num_layers, b, s, kh, d = _check_cache_args(k_LxBxSxKxD, v_LxBxSxKxD, slot_mask_BxS, backend, block_s)
  if sync is not None and (sync.shape != (b * kh,) or sync.dtype != jnp.int32):
    raise ValueError(f"sync must be int32 [B * Hkv = {b * kh}] (new_sync); got {sync.dtype}{list(sync.shape)}")
  if num_heads % kh:
    raise ValueError(f"{num_heads} query heads are not a multiple of {kh} KV heads")
  _check_scalars("decode_attention_append", layer, length)
  if d % 2:
    raise ValueError(f"RoPE needs an even head dim, got {d}")
  n = (num_heads + 2 * kh) * d
  head_of_buffer = qkv_BxN.ndim == 1
  if head_of_buffer and (qkv_BxN.dtype != jnp.float32 or qkv_BxN.shape[0] < b * n or qkv_BxN.shape[0] % d):
    raise ValueError(f"a 1-D qkv buffer must be float32, at least B * (H + 2 Hkv) * hd = {b * n} long and a "
                     f"multiple of hd = {d}; got {qkv_BxN.dtype}{list(qkv_BxN.shape)}")
  if not head_of_buffer and qkv_BxN.shape != (b, n):
    raise ValueError(f"qkv must be [B={b}, (H + 2 Hkv) * hd = {n}]; got {qkv_BxN.shape}")
  if bias_N is not None and bias_N.shape not in ((n,), (num_layers, n)):
    raise ValueError(f"bias must be [{n}] or a stack [L={num_layers}, {n}]; got {bias_N.shape}")
  if cos_BxR.shape != (b, d // 2) or sin_BxR.shape != (b, d // 2):
    raise ValueError(f"cos and sin must be [B={b}, hd / 2 = {d // 2}]; got {cos_BxR.shape} and {sin_BxR.shape}")
  backend = _resolve_backend(backend, dtype, d, APPEND_MIN_HEAD_DIM, "decode_attention_append",
                             "its output is wrong below that")
  if backend == "reference":
    out = reference_append(qkv_BxN, bias_N, k_LxBxSxKxD, v_LxBxSxKxD, layer, slot_mask_BxS, length,
                           cos_BxR, sin_BxR, num_heads=num_heads, dtype=dtype)
    return out if sync is None else (*out, sync)

  g, g_pad, block_s, nsplit, chunk = _geometry(b, num_heads, kh, s, block_s, splits, target_programs)
  combine = sync is not None
  merge_chunk = min(MERGE_CHUNK, _pow2(nsplit))
  kernel = functools.partial(_append_kernel, batch=b, heads=num_heads, heads_kv=kh, group=g, group_pad=g_pad,
                             slots=s, head_dim=d, block_s=block_s, chunk=chunk, nsplit=nsplit,
                             num_layers=num_layers, dtype=jnp.dtype(dtype),
                             bias_stacked=bias_N is not None and bias_N.ndim == 2, dynamic_chunks=bool(dynamic_chunks),
                             combine=combine, interpret=backend == "interpret", group_rows=_pow2(g),
                             merge_chunk=merge_chunk)
  flat = (num_layers * b * s, kh * d)
  # (with the merge, room for whole chunks of splits: its loads are masked past the last one)
  parts = -(-nsplit // merge_chunk) * merge_chunk if combine else nsplit
  out_shape = (jax.ShapeDtypeStruct((parts, b, kh, g_pad, d), jnp.float32),
               jax.ShapeDtypeStruct((parts, b, kh, g_pad), jnp.float32),
               jax.ShapeDtypeStruct((parts, b, kh, g_pad), jnp.float32),
               jax.ShapeDtypeStruct(flat, k_LxBxSxKxD.dtype), jax.ShapeDtypeStruct(flat, v_LxBxSxKxD.dtype))
  args = (qkv_BxN.astype(jnp.float32).reshape(-1, d), (jnp.zeros((n,), jnp.float32) if bias_N is None
                                                       else bias_N).reshape(-1, d),
          cos_BxR.astype(jnp.float32), sin_BxR.astype(jnp.float32),
          k_LxBxSxKxD.reshape(flat), v_LxBxSxKxD.reshape(flat), slot_mask_BxS.astype(jnp.int8),
          jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(length, jnp.int32).reshape(1))
  aliases = {4: 3, 5: 4}
  if combine:
    out_shape += (jax.ShapeDtypeStruct((b * num_heads, d), jnp.dtype(dtype)), jax.ShapeDtypeStruct((b * kh,), jnp.int32))
    args += (sync,)
    aliases[9] = 6
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    res = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(b, kh, nsplit), interpret=backend == "interpret",
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="decode_attention_append",
    )(*args)
  o, m, l, kc, vc = res[:5]
  kc, vc = kc.reshape(k_LxBxSxKxD.shape), vc.reshape(v_LxBxSxKxD.shape)
  if combine:
    return res[5].reshape(b, num_heads, d), kc, vc, res[6]
  return _combine(o, m, l, g, dtype), kc, vc

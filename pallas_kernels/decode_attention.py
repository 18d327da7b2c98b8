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


def auto_backend(dtype) -> str:
  """What ``backend="auto"`` runs for queries of ``dtype``: ``"pallas"`` on a GPU for 16-bit
  queries, else ``"reference"`` (float32 stays on XLA: Triton's float32 dots are TF32)."""
  on_gpu = jax.default_backend() in ("gpu", "cuda")
  return "pallas" if on_gpu and jnp.dtype(dtype).itemsize == 2 else "reference"


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
  s_begin = split * chunk
  s_end = jnp.minimum(s_begin + chunk, length)
  blocks = jnp.maximum(s_end - s_begin + block_s - 1, 0) // block_s
  scale = head_dim ** -0.5

  def body(i, carry):
    m, l, acc = carry
    s0 = s_begin + i * block_s
    idx = s0 + jnp.arange(block_s)
    inside = idx < s_end
    keep = plgpu.load(mask_ref.at[b, pl.ds(s0, block_s)], mask=inside, other=0) != 0
    keep = keep & inside
    k = plgpu.load(k_ref.at[pl.ds(row0 + s0, block_s), col], mask=inside[:, None], other=0.0).astype(q.dtype)
    v = plgpu.load(v_ref.at[pl.ds(row0 + s0, block_s), col], mask=inside[:, None], other=0.0).astype(q.dtype)
    sc = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    sc = jnp.where(keep[None, :], sc, MASKED_SCORE)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(keep[None, :], jnp.exp(sc - m_new[:, None]), 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l, acc

  init = (jnp.full((g,), MASKED_SCORE, jnp.float32), jnp.zeros((g,), jnp.float32),
          jnp.zeros((g, head_dim), jnp.float32))
  m, l, acc = lax.fori_loop(0, blocks, body, init)
  o_ref[split, b, kvh] = acc
  m_ref[split, b, kvh] = m
  l_ref[split, b, kvh] = l


def _choose_splits(batch: int, heads_kv: int, slots: int, block_s: int, target_programs: int) -> int:
  return int(max(1, min(-(-slots // block_s), -(-target_programs // (batch * heads_kv)))))


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
    ValueError: inconsistent shapes, ``H`` not a multiple of ``Hkv``, a bad
      ``block_s`` or an unknown backend.
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
  if k_LxBxSxKxD.ndim != 5 or v_LxBxSxKxD.shape != k_LxBxSxKxD.shape:
    raise ValueError(f"k and v caches must both be [L, B, S, Hkv, hd]; got {k_LxBxSxKxD.shape} and "
                     f"{v_LxBxSxKxD.shape}")
  num_layers, b, s, kh, d = k_LxBxSxKxD.shape
  if q_BxHxD.ndim != 3 or q_BxHxD.shape[0] != b or q_BxHxD.shape[2] != d:
    raise ValueError(f"q must be [B={b}, H, hd={d}]; got {q_BxHxD.shape}")
  h = q_BxHxD.shape[1]
  if h % kh:
    raise ValueError(f"{h} query heads are not a multiple of {kh} KV heads")
  if slot_mask_BxS.shape != (b, s):
    raise ValueError(f"slot_mask must be [B={b}, S={s}]; got {slot_mask_BxS.shape}")
  if block_s < 16 or block_s & (block_s - 1):
    raise ValueError(f"block_s must be a power of 2 >= 16, got {block_s}")
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  length = jnp.asarray(length, jnp.int32).reshape(1)
  if backend == "auto":
    backend = auto_backend(q_BxHxD.dtype)
  if backend == "reference":
    return reference(q_BxHxD, k_LxBxSxKxD, v_LxBxSxKxD, jnp.clip(layer[0], 0, num_layers - 1), slot_mask_BxS,
                     length[0])

  g = h // kh
  g_pad = max(16, 1 << (g - 1).bit_length())  # tensor-core dots need >= 16 rows
  block_s = min(block_s, max(16, 1 << (s - 1).bit_length()))
  nsplit = splits or _choose_splits(b, kh, s, block_s, target_programs)
  chunk = -(-(-(-s // nsplit)) // block_s) * block_s  # slots per split, a multiple of block_s
  nsplit = -(-s // chunk)
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
  # Combine the splits: weights exp(m_i - max_i m_i); empty splits have l = 0.
  top = jnp.max(m, axis=0)
  w = jnp.exp(m - top[None])
  den = jnp.sum(w * l, axis=0)
  num = jnp.sum(w[..., None] * o, axis=0)
  out = num / jnp.where(den > 0, den, 1.0)[..., None]
  return out[:, :, :g].reshape(b, h, d).astype(q_BxHxD.dtype)

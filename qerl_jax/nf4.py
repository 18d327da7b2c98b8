"""NF4 weights (QLoRA's 4-bit NormalFloat), the QLoRA baseline the paper compares with.

For a weight ``w`` of shape ``[K, N]``, blocks of 64 run along K; each block
keeps its absmax ``a`` (float32); each value is stored as the index of the
nearest of the 16 NormalFloat levels to ``w / a``; the dequantized value is
``NF4_CODEBOOK[q] * a``. Codes pack two per byte exactly as NVFP4's do.

Reference: Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs"
(2023), Appendix E (the NF4 levels, as in bitsandbytes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import _packing

BLOCK_SIZE = 64

# The 16 NormalFloat-4 levels (QLoRA, bitsandbytes), ascending; index 7 is exactly 0.
NF4_CODEBOOK = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236328, 1.0,
], np.float32)
_MIDPOINTS = ((NF4_CODEBOOK[1:] + NF4_CODEBOOK[:-1]) / 2).astype(np.float32)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NF4Tensor:
  """A frozen NF4 weight of logical shape ``[K, N]``.

  * ``packed``: uint8 ``[..., K // 2, N]`` (codes of rows 2j / 2j+1 in the low / high nibble);
  * ``block_scale``: float32 ``[..., K // 64, N]``, the absmax of each block;
  * ``shape``: static ``(K, N)``.
  """

  packed: jax.Array
  block_scale: jax.Array
  shape: tuple[int, int]

  def tree_flatten(self):
    return (self.packed, self.block_scale), self.shape

  @classmethod
  def tree_unflatten(cls, shape, children):
    return cls(*children, shape=shape)

  @property
  def nbytes(self) -> int:
    """Bytes held by the packed codes and the block scales."""
    return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                   for a in (self.packed, self.block_scale)))

  def __repr__(self):
    if not _packing.is_array_like(self.packed):  # a tree_map's result (shapes, names, ...): show the leaves
      return f"NF4Tensor(packed={self.packed!r}, block_scale={self.block_scale!r}, shape={tuple(self.shape)})"
    lead = tuple(self.packed.shape[:-2])
    return f"NF4Tensor(shape={lead + tuple(self.shape)}, block=64)"


@jax.jit
def _quantize_core(w: jax.Array) -> NF4Tensor:
  k, n = w.shape[-2:]
  w = w.astype(jnp.float32)
  blocks = w.reshape(*w.shape[:-2], k // BLOCK_SIZE, BLOCK_SIZE, n)
  absmax = jnp.max(jnp.abs(blocks), axis=-2)  # [..., K/64, N]
  safe = jnp.where(absmax > 0, absmax, 1.0)
  normed = _packing.exact_divide(blocks, safe[..., :, None, :])
  # Nearest level: count the midpoints strictly below the value, so a value exactly
  # on a midpoint takes the lower level (bitsandbytes' dQuantizeNF4 tests `x > midpoint`).
  codes = jnp.sum(normed[..., None] > jnp.asarray(_MIDPOINTS), axis=-1).astype(jnp.uint8)
  # Checked on the values themselves: XLA's CPU max reduction may drop a NaN.
  finite = jnp.all(jnp.isfinite(blocks))
  return NF4Tensor(_packing.pack_nibbles(codes.reshape(w.shape)), absmax, (k, n)), finite


def quantize(w, *, pad: bool = False) -> NF4Tensor:
  """Quantizes ``w`` ``[..., K, N]`` to NF4 (blocks of 64 along K, float32 absmax).

  Each value becomes the index of the nearest NormalFloat level to ``w / absmax``
  (a value exactly between two levels takes the lower one). An all-zero block
  keeps absmax 0 and dequantizes to exact zeros.

  Args:
    w: float array ``[..., K, N]`` (computed in float32).
    pad: zero-pad K up to a multiple of 64 instead of raising.

  Returns:
    :class:`NF4Tensor` of logical shape ``(K, N)``.

  Raises:
    ValueError: K not a multiple of 64 (unless ``pad``), a rank below 2, an empty K or N, or
      NaN/Inf in a concrete ``w`` (how many and where).
    TypeError: a weight that is not floating point (int, bool, complex). Works under ``jax.jit``
      (the value check is then skipped).
  """
  n_pad = _packing.checked_k_padding(tuple(w.shape), BLOCK_SIZE, "nf4.quantize", pad,
                                        getattr(w, "dtype", None))
  w = jnp.asarray(w)
  if n_pad:
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, n_pad), (0, 0)])
  t, finite = _quantize_core(w)
  if not isinstance(finite, jax.core.Tracer) and not bool(finite):
    _packing.check_finite(w, "nf4.quantize")  # raises with the count and location
  return t


def dequantize(t: NF4Tensor, dtype=jnp.float32) -> jax.Array:
  """``NF4_CODEBOOK[q] * absmax``, shape ``[..., K, N]``, computed in float32.

  Raises:
    TypeError: if ``t`` is not an NF4Tensor.
  """
  if not isinstance(t, NF4Tensor):
    raise TypeError(f"nf4.dequantize expects an NF4Tensor, got {type(t).__name__}")
  k, n = t.shape
  values = _packing.decode(_packing.unpack_nibbles(t.packed), NF4_CODEBOOK)
  lead = values.shape[:-2]
  out = values.reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE, n) * t.block_scale[..., :, None, :]
  return out.reshape(*lead, k, n).astype(dtype)

"""NVFP4 weights: E2M1 codes, E4M3 block scales of 16, one float32 global scale.

The recipe is compressed-tensors' ``NVFP4A16`` round-to-nearest (the format
QeRL's checkpoints use, read by vLLM and written by llm-compressor), reproduced
bit for bit (tested against compressed-tensors 0.20 on float32 and bf16 weights).
For a weight ``w`` of shape ``[K, N]`` (K = input features, the contraction axis;
blocks of 16 run along K):

* global scale ``gs = 448 * 6 / amax(|w|)`` (float32, a *divisor*; ModelOpt
  stores its inverse as ``weight_scale_2``), evaluated as PyTorch does,
  ``2688 * (1 / amax)``, rounded to ``w``'s dtype at each step when ``w`` is
  bf16/f16;
* block scale ``s = float8_e4m3fn(clamp(gs * (amax_block / 6), -448, 448))``
  (the division in ``w``'s dtype, the product in float32); a block scale that is
  0 becomes 0.125;
* code ``q = RNE_E2M1(clamp(w / (float32(s) / gs), -6, 6))`` in float32, E2M1
  magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign;
* dequantized value ``e2m1(q) * (float32(s) / gs)``.

An all-zero matrix gets ``gs = 1`` (exact zeros), as compressed-tensors 0.20 does.
One deliberate difference: where ``2688 * (1 / amax)`` overflows or flushes to zero in
``w``'s dtype (an f16 weight with ``amax < 2688 / 65504 ~ 0.041``; ``amax > 2^126``),
``gs = float32(2688 / amax)``; compressed-tensors 0.20 replaces such a scale by 1.0, which
leaves blocks of small weights with scales near or at E4M3's zero.

References: OCP Microscaling Formats (MX) v1.0 spec (E2M1, E4M3); NVIDIA
NVFP4 (two-level scaling, 16-element blocks); compressed-tensors
``nvfp4-pack-quantized`` and ``generate_gparam``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import _packing

BLOCK_SIZE = 16  # group size along K
E4M3_MAX = 448.0
E2M1_MAX = 6.0
ZERO_BLOCK_SCALE = 0.125  # what a block scale that rounds to 0 becomes

# Code c in [0, 16): magnitude E2M1_MAGNITUDES[c & 7], negative when bit 3 is set.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_CODEBOOK = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
  """A frozen NVFP4 weight of logical shape ``[K, N]`` (K = contraction axis).

  In-memory layout (chosen for the kernels, which tile along K and N):

  * ``packed``: uint8 ``[..., K // 2, N]``; byte ``j`` of column ``n`` holds the
    E2M1 code of row ``2j`` in the low nibble and of row ``2j + 1`` in the high
    nibble.
  * ``block_scale``: float8_e4m3fn ``[..., K // 16, N]``, one per 16 rows of K.
  * ``global_scale``: float32 ``[...]`` (a scalar per matrix), the divisor ``gs``.
  * ``shape``: static ``(K, N)``, the trailing logical shape.
  * ``code_order``: static, ``"standard"`` (the layout above) or ``"decode"``: the
    bits of each 4-byte block (code rows ``2i, 2i + 1`` x columns ``2c, 2c + 1``)
    rearranged for the GPU decode kernel (:func:`to_decode_order`). Every
    function here and in :mod:`pallas_kernels` accepts both.

  Leading dimensions ``...`` (for example stacked decoder layers) are allowed on
  all three arrays; ``shape`` always names the trailing two.
  The checkpoint layout (``[N, K/2]``, ``[N, K/16]``) is produced by
  :func:`to_compressed_tensors`.
  """

  packed: jax.Array
  block_scale: jax.Array
  global_scale: jax.Array
  shape: tuple[int, int]
  code_order: str = "standard"

  def __post_init__(self):
    if self.code_order not in CODE_ORDERS:
      raise ValueError(f"NVFP4Tensor: code_order must be one of {CODE_ORDERS}, got {self.code_order!r}")

  def tree_flatten(self):
    return (self.packed, self.block_scale, self.global_scale), (self.shape, self.code_order)

  @classmethod
  def tree_unflatten(cls, aux, children):
    shape, code_order = aux
    return cls(*children, shape=shape, code_order=code_order)

  @property
  def dtype(self):
    """``uint8``, the storage dtype of the packed E2M1 codes (two a byte); not the dequantized dtype."""
    return jnp.dtype("uint8")

  @property
  def nbytes(self) -> int:
    """Bytes held by the three arrays."""
    return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                   for a in (self.packed, self.block_scale, self.global_scale)))

  def __repr__(self):
    if not _packing.is_array_like(self.packed):  # a tree_map's result (shapes, names, ...): show the leaves
      return (f"NVFP4Tensor(packed={self.packed!r}, block_scale={self.block_scale!r}, "
              f"global_scale={self.global_scale!r}, shape={tuple(self.shape)}, code_order={self.code_order!r})")
    lead = tuple(self.packed.shape[:-2])
    order = "" if self.code_order == "standard" else f", code_order={self.code_order!r}"
    return (f"NVFP4Tensor(shape={lead + tuple(self.shape)}, block=16, packed={self.packed.dtype}"
            f"{list(self.packed.shape)}{order})")


CODE_ORDERS = ("standard", "decode")


def _decode_order_bits() -> np.ndarray:
  """``new[b]``: the bit of a decode-order block word that holds bit ``b`` of the standard one.

  A block word is the 4 bytes of code rows ``2i, 2i + 1`` x columns ``2c, 2c + 1``, little-endian
  in the order (row 2i, col 2c), (row 2i, col 2c + 1), (row 2i + 1, col 2c), (row 2i + 1, col 2c + 1):
  the word the GPU kernel forms with one ``prmt`` from its two code-row loads. Its 8 E2M1 values are
  ``(column q, row r, nibble h)``; the kernel turns them into 4 bf16x2 registers, one per
  ``(q, h)``, holding row 0 in the low half and row 1 in the high half, by placing each code's sign
  at bit 15 and its three magnitude bits at 8..6 of its half. In the decode order, register
  ``(0, 0)`` is ``word & 0x81C081C0``, ``(0, 1)`` and ``(1, 0)`` the same after a left shift of 3
  and 6, and ``(1, 1)`` three shifted pieces: 11 integer instructions for 4 registers where the
  standard order takes about 15 (docs/kernels.md, "Code order").
  """
  # field f of a code: 0 = m (mantissa), 1 = e0, 2 = e1, 3 = sign; positions within a 16-bit half
  slots = {(0, 0): (6, 7, 8, 15), (0, 1): (3, 4, 5, 12), (1, 0): (0, 1, 2, 9), (1, 1): (14, 10, 11, 13)}
  new = np.zeros(32, np.int64)
  for (q, h), pos in slots.items():
    for r in range(2):
      for f in range(4):
        new[8 * (2 * r + q) + 4 * h + f] = 16 * r + pos[f]
  assert sorted(new) == list(range(32))
  return new


DECODE_ORDER_BITS = _decode_order_bits()
# The two permutations as hashable tuples (the static argument of _permute_block_bits_fused).
_TO_DECODE = tuple(int(b) for b in DECODE_ORDER_BITS)
_TO_STANDARD = tuple(int(b) for b in np.argsort(DECODE_ORDER_BITS))


def permute_word_bits(word: jax.Array, new_of_old: np.ndarray) -> jax.Array:
  """Moves bit ``b`` of every uint32 in ``word`` to bit ``new_of_old[b]``.

  One mask and one shift per distinct distance. Plain ``jnp`` operations, so Pallas kernels use it
  too (``pallas_kernels.w4_triton``'s decode-order dequantize, with the inverse of
  :data:`DECODE_ORDER_BITS`).

  Args:
    word: uint32 array, any shape.
    new_of_old: int array ``[32]``, a permutation of 0..31 (static: numpy).

  Returns:
    uint32, ``word``'s shape.
  """
  out = jnp.zeros_like(word)
  for delta, mask in bit_moves(new_of_old):
    moved = word & jnp.uint32(mask)
    out = out | (moved << delta if delta >= 0 else moved >> -delta)
  return out


def bit_moves(new_of_old: np.ndarray) -> tuple[tuple[int, int], ...]:
  """The bit permutation ``new_of_old`` (bit ``b`` to bit ``new_of_old[b]`` of a 32-bit word) as ``(shift, mask)``
  pairs, one per distinct distance, ascending: the word is ``OR of (word & mask) << shift`` (a negative shift moves
  right). What :func:`permute_word_bits` applies; GPU kernels that permute in registers take the same pairs.

  Args:
    new_of_old: int array ``[32]``, a permutation of 0..31 (static: numpy).

  Returns:
    tuple of ``(shift, mask)``, ``mask`` an unsigned 32-bit value.
  """
  moves = new_of_old - np.arange(32)
  return tuple((d, sum(1 << int(b) for b in np.nonzero(moves == d)[0])) for d in sorted(set(int(v) for v in moves)))


def _permute_block_bits(packed: jax.Array, new_of_old: np.ndarray) -> jax.Array:
  """Applies the bit permutation ``new_of_old`` to every 4-byte block word of ``packed``
  ``[..., K/2, N]`` (K/2 and N even); grouped by shift, one mask per distinct shift. Column pairs
  are read as little-endian uint16 (a bitcast), so the block word is two 16-bit loads a code-row
  pair apart."""
  *lead, k2, n = packed.shape
  pairs = jax.lax.bitcast_convert_type(packed.reshape(*lead, k2 // 2, 2, n // 2, 2), jnp.uint16)
  word = pairs[..., 0, :].astype(jnp.uint32) | (pairs[..., 1, :].astype(jnp.uint32) << 16)  # [..., K/4, N/2]
  out = permute_word_bits(word, new_of_old)
  out = jnp.stack([out & 0xFFFF, out >> 16], axis=-2).astype(jnp.uint16)  # [..., K/4, 2, N/2]
  return jax.lax.bitcast_convert_type(out, jnp.uint8).reshape(packed.shape)


@functools.partial(jax.jit, static_argnums=1)
def _permute_block_bits_fused(packed: jax.Array, new_of_old: tuple) -> jax.Array:
  """:func:`_permute_block_bits` as one jitted, elementwise pass: XLA fuses it into a loop from the codes
  to the new codes, so converting a tensor holds only the input and its copy. Run op by op (eagerly) its
  uint32 intermediates took several times the codes' bytes: loading the 32B base peaked at 84 GiB. A stack
  of layers ``[L, K/2, N]`` goes a layer at a time (``lax.map``), so the pass's own scratch is a layer's."""
  if packed.ndim > 2:
    return jax.lax.map(lambda p: _permute_block_bits(p, np.asarray(new_of_old)), packed)
  return _permute_block_bits(packed, np.asarray(new_of_old))


def to_decode_order(t: NVFP4Tensor) -> NVFP4Tensor:
  """``t`` with its codes in the GPU decode kernel's order (``code_order="decode"``).

  Same values, same shapes and bytes; only the bits inside each 4-byte block of code rows
  ``2i, 2i + 1`` and columns ``2c, 2c + 1`` move (:data:`DECODE_ORDER_BITS`). The Gluon decode
  kernel (:mod:`pallas_kernels.w4_gluon`) then spends about a third fewer instructions on the E2M1
  decode, and the large-M dequantize kernel reads it in place too; the other paths convert back first
  (:func:`to_standard_order`, a pass over the codes).
  A no-op on a tensor already in decode order. Works under ``jax.jit``.

  Raises:
    TypeError: ``t`` is not an NVFP4Tensor.
    ValueError: ``N`` is odd (blocks pair columns).
  """
  if not isinstance(t, NVFP4Tensor):
    raise TypeError(f"nvfp4.to_decode_order expects an NVFP4Tensor, got {type(t).__name__}")
  if t.code_order == "decode":
    return t
  if t.shape[1] % 2:
    raise ValueError(f"nvfp4.to_decode_order: N must be even (blocks pair columns), got shape {t.shape}")
  return dataclasses.replace(t, packed=_permute_block_bits_fused(t.packed, _TO_DECODE), code_order="decode")


def to_standard_order(t: NVFP4Tensor) -> NVFP4Tensor:
  """The inverse of :func:`to_decode_order` (a no-op on a standard-order tensor).

  Raises:
    TypeError: ``t`` is not an NVFP4Tensor.
  """
  if not isinstance(t, NVFP4Tensor):
    raise TypeError(f"nvfp4.to_standard_order expects an NVFP4Tensor, got {type(t).__name__}")
  if t.code_order == "standard":
    return t
  return dataclasses.replace(t, packed=_permute_block_bits_fused(t.packed, _TO_STANDARD), code_order="standard")


def round_to_e2m1(x: jax.Array) -> jax.Array:
  """Rounds values to E2M1 codes with round-to-nearest-even on ties.

  Args:
    x: float array, any shape; values outside [-6, 6] saturate.

  Returns:
    uint8 codes, same shape: magnitude index in bits 0-2, sign in bit 3
    (negative inputs, including those that round to zero, set the sign bit,
    as compressed-tensors does).

  Ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
  """
  x = x.astype(jnp.float32)
  m = jnp.minimum(jnp.abs(x), E2M1_MAX)
  # Thresholds between neighbouring magnitudes; `>` where the lower code is even
  # (a tie stays down), `>=` where the upper code is even (a tie goes up).
  code = ((m > 0.25).astype(jnp.uint8) + (m >= 0.75) + (m > 1.25) + (m >= 1.75)
          + (m > 2.5) + (m >= 3.5) + (m > 5.0)).astype(jnp.uint8)
  sign = jnp.where(x < 0, jnp.uint8(8), jnp.uint8(0))
  return code | sign


_REDUCED_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _round_to(x: jax.Array, dtype) -> jax.Array:
  """Float32 ``x`` rounded (RNE) to ``dtype`` and back; the identity for float32. The rounded
  value is materialized (:func:`_packing.materialize`): XLA on a GPU would drop the round trip."""
  return x if dtype is None else _packing.materialize(x.astype(dtype)).astype(jnp.float32)


def _global_scale_from_amax(amax: jax.Array, dtype=None) -> jax.Array:
  """``2688 * (1 / amax)`` with the rounding of compressed-tensors' ``generate_gparam``.

  PyTorch evaluates ``scalar / tensor`` as ``tensor.reciprocal() * scalar``, each step
  rounded to the tensor's dtype; ``dtype`` (bf16/f16, or None for float32) is that dtype.
  """
  safe = jnp.where(amax > 0, amax, 1.0).astype(jnp.float32)
  # An opaque 1 (materialized): with a literal 1 as the numerator, a GPU's quotient came out one
  # float32 ulp high (amax = 10000; docs/benchmarks.md, session 19).
  one = _packing.materialize(jnp.ones_like(safe))
  recip = _round_to(_packing.exact_divide(one, safe), dtype)
  gs = _round_to(recip * jnp.float32(E4M3_MAX * E2M1_MAX), dtype)
  # Where those steps overflow (an f16 weight with amax < 2688 / 65504 ~ 0.041: inf) or flush to
  # zero (amax > 2^126: a subnormal reciprocal, flushed by XLA), the quotient is taken once in
  # float32 instead. Left as it was, inf saturated to float32 max and 0 divided by zero: every
  # code then dequantized to ~0 or NaN.
  direct = _packing.exact_divide(_packing.materialize(jnp.full_like(safe, E4M3_MAX * E2M1_MAX)), safe)
  gs = jnp.where(jnp.isfinite(gs) & (gs > 0), gs, direct)
  gs = jnp.where(amax > 0, gs, 1.0)
  return jnp.minimum(gs, jnp.finfo(jnp.float32).max).astype(jnp.float32)


def _reduced(dtype):
  return jnp.dtype(dtype) if jnp.dtype(dtype) in _REDUCED_FLOATS else None


@jax.jit
def compute_global_scale(w: jax.Array) -> jax.Array:
  """The NVFP4 global scale ``448 * 6 / amax(|w|)`` over the trailing ``[K, N]`` axes.

  Computed as compressed-tensors' ``generate_gparam`` does in PyTorch:
  ``2688 * (1 / amax)``, each step rounded to ``w``'s dtype when that is bf16/f16 (so a
  bf16 weight gets a bf16-valued global scale), in float32 otherwise.

  Args:
    w: float array ``[..., K, N]``.

  Returns:
    float32 ``[...]``, a divisor. An all-zero matrix gets 1.0 (any value gives exact
    zeros). Where the steps in ``w``'s dtype overflow or flush to zero (f16 with
    ``amax < ~0.041``, or ``amax > 2^126``), the result is ``float32(2688 / amax)``
    instead; a result that overflows float32 saturates to float32 max.
  """
  amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(-2, -1))
  return _global_scale_from_amax(amax, _reduced(w.dtype))


@jax.jit
def _quantize_core(w: jax.Array, global_scale) -> tuple[NVFP4Tensor, jax.Array]:
  """The jit-able recipe, one pass over ``w``; returns the tensor and an all-finite flag."""
  k, n = w.shape[-2:]
  low = _reduced(w.dtype)  # compressed-tensors computes the scale statistics in w's dtype
  blocks = w.reshape(*w.shape[:-2], k // BLOCK_SIZE, BLOCK_SIZE, n)
  # |w| and its max are exact in w's own dtype (a bf16 reduction reads half the bytes).
  amax_block = jnp.max(jnp.abs(blocks), axis=-2).astype(jnp.float32)  # [..., K/16, N]
  blocks = blocks.astype(jnp.float32)
  amax = jnp.max(amax_block, axis=(-2, -1))  # [...], NaN/Inf when w has any
  # (Checked on the values themselves: XLA's CPU max reduction may drop a NaN.)
  finite = jnp.all(jnp.isfinite(blocks))
  gs = _global_scale_from_amax(amax, low) if global_scale is None else global_scale.astype(jnp.float32)
  gs_b = gs[..., None, None]
  # compressed-tensors calculate_qparams: global_scale * (amax_block / 6) with the division in
  # w's dtype and the product in float32, clamp, cast to E4M3. (Divisions go through
  # exact_divide: XLA would otherwise turn them into reciprocal multiplies, one ulp off.)
  s = jnp.clip(gs_b * _round_to(_packing.exact_divide(amax_block, E2M1_MAX), low), -E4M3_MAX, E4M3_MAX)
  # (materialized: on a GPU XLA would otherwise test and divide by the unrounded float32 scale)
  s = _packing.materialize(s.astype(jnp.float8_e4m3fn))
  s = jnp.where(s.astype(jnp.float32) == 0, jnp.float8_e4m3fn(ZERO_BLOCK_SCALE), s)
  scale = _packing.exact_divide(s.astype(jnp.float32), gs_b)  # [..., K/16, N]
  scaled = jnp.clip(_packing.exact_divide(blocks, scale[..., :, None, :]), -E2M1_MAX, E2M1_MAX)
  codes = round_to_e2m1(scaled).reshape(w.shape)
  return NVFP4Tensor(_packing.pack_nibbles(codes), s, gs, (k, n)), finite


def quantize(w, *, global_scale=None, pad: bool = False) -> NVFP4Tensor:
  """Quantizes a weight to NVFP4 (compressed-tensors NVFP4A16 RTN recipe).

  Args:
    w: float array ``[..., K, N]``. The scale statistics are computed in ``w``'s dtype
      when it is bf16/f16 (as compressed-tensors does), everything else in float32.
      Leading dims (stacked layers) each get their own global scale.
    global_scale: optional float32 divisor, a scalar or ``[...]``, to use
      instead of ``448 * 6 / amax(|w|)``; fused projections (q/k/v, gate/up)
      share one, the smallest of the group, as vLLM requires.
    pad: zero-pad K up to a multiple of 16 instead of raising. The padded rows
      are part of the stored tensor (``shape[0]`` is the padded K).

  Returns:
    :class:`NVFP4Tensor` of logical shape ``(K, N)``.

  Raises:
    TypeError: a weight that is not floating point (int, bool, complex).
    ValueError: K not a multiple of 16 (and ``pad`` is False), a rank below 2, an empty K or N,
      a global scale that is not finite and > 0, or NaN/Inf in a concrete ``w``
      (the message says how many and where). Traced inputs (inside ``jit``) are
      not checked for NaN/Inf.

  Works under ``jax.jit`` (the checks on values are then skipped).
  """
  shape = tuple(w.shape)
  n_pad = _packing.checked_k_padding(shape, BLOCK_SIZE, "nvfp4.quantize", pad, getattr(w, "dtype", None))
  w = jnp.asarray(w)
  if n_pad:
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, n_pad), (0, 0)])
  if global_scale is not None:
    global_scale = jnp.asarray(global_scale, jnp.float32)
    if not isinstance(global_scale, jax.core.Tracer):
      gs_np = np.asarray(global_scale)
      if not np.all(np.isfinite(gs_np)) or np.any(gs_np <= 0):
        raise ValueError(f"nvfp4.quantize: global_scale must be finite and > 0, got {gs_np}")
    lead = w.shape[:-2]
    if global_scale.size == 1:
      global_scale = jnp.broadcast_to(global_scale.reshape(()), lead)
    elif global_scale.shape != lead:
      raise ValueError(f"nvfp4.quantize: global_scale of shape {global_scale.shape} matches neither one "
                       f"scale nor the leading dims {lead} of w of shape {shape}")
  t, finite = _quantize_core(w, global_scale)
  if not isinstance(finite, jax.core.Tracer) and not bool(finite):
    _packing.check_finite(w, "nvfp4.quantize")  # raises with the count and location
  return t


def dequantize(t: NVFP4Tensor, dtype=jnp.float32) -> jax.Array:
  """Dequantizes to ``e2m1(q) * (float32(s) / gs)``, shape ``[..., K, N]``.

  Args:
    t: an :class:`NVFP4Tensor`.
    dtype: output dtype (computed in float32, then cast).

  Raises:
    TypeError: if ``t`` is not an NVFP4Tensor.
  """
  if not isinstance(t, NVFP4Tensor):
    raise TypeError(f"nvfp4.dequantize expects an NVFP4Tensor, got {type(t).__name__}")
  t = to_standard_order(t)
  k, n = t.shape
  codes = _packing.unpack_nibbles(t.packed)
  values = _packing.decode(codes, E2M1_CODEBOOK)  # [..., K, N] f32
  scale = _packing.exact_divide(t.block_scale.astype(jnp.float32),
                                t.global_scale.astype(jnp.float32)[..., None, None])
  lead = values.shape[:-2]
  out = values.reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE, n) * scale[..., :, None, :]
  return out.reshape(*lead, k, n).astype(dtype)


def to_compressed_tensors(t: NVFP4Tensor) -> dict[str, np.ndarray]:
  """The checkpoint layout of compressed-tensors ``nvfp4-pack-quantized``.

  Returns:
    ``weight_packed`` uint8 ``[N, K/2]`` (element 2j in the low nibble),
    ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_global_scale``
    float32 ``[1]`` (the divisor). Leading dims are not supported here.

  Raises:
    ValueError: ``t`` has leading (stacked) dims.
  """
  if t.packed.ndim != 2:
    raise ValueError(f"to_compressed_tensors expects one matrix, got packed shape {t.packed.shape}")
  t = to_standard_order(t)
  codes = np.asarray(_packing.unpack_nibbles(t.packed))  # [K, N]
  codes_t = codes.T  # [N, K]
  packed = (codes_t[:, 0::2] | (codes_t[:, 1::2] << 4)).astype(np.uint8)
  return {
      "weight_packed": np.ascontiguousarray(packed),
      "weight_scale": np.ascontiguousarray(np.asarray(t.block_scale).T),
      "weight_global_scale": np.asarray(t.global_scale, np.float32).reshape(1),
  }


def from_compressed_tensors(weight_packed, weight_scale, weight_global_scale) -> NVFP4Tensor:
  """Builds an :class:`NVFP4Tensor` from the compressed-tensors checkpoint layout.

  Args:
    weight_packed: uint8 ``[N, K/2]``.
    weight_scale: float8_e4m3fn ``[N, K/16]``.
    weight_global_scale: float32 ``[1]`` or ``[]``, a divisor. (For ModelOpt's
      ``weight_scale_2``, a multiplier, pass ``1 / weight_scale_2``.)

  Raises:
    ValueError: on mismatched shapes or dtypes, K (twice the packed width) not a multiple
      of 16, a NaN block scale, or a global scale that is not one finite value > 0.
  """
  weight_packed = np.asarray(weight_packed)
  weight_scale = np.asarray(weight_scale)
  if weight_packed.dtype != np.uint8 or weight_packed.ndim != 2:
    raise ValueError(f"weight_packed must be uint8 [N, K/2], got {weight_packed.dtype}{list(weight_packed.shape)}")
  n, k2 = weight_packed.shape
  k = 2 * k2
  if k % BLOCK_SIZE:
    raise ValueError(f"weight_packed {list(weight_packed.shape)} gives K = {k}, not a multiple of the "
                     f"block size {BLOCK_SIZE}")
  if weight_scale.shape != (n, k // BLOCK_SIZE):
    raise ValueError(f"weight_scale shape {weight_scale.shape} does not match weight_packed "
                     f"{weight_packed.shape}: expected {(n, k // BLOCK_SIZE)}")
  if weight_scale.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
  nan = np.argwhere((weight_scale.view(np.uint8) & 0x7F) == 0x7F)  # E4M3's only NaN codes: every weight of
  if nan.size:  # such a block dequantized to NaN
    raise ValueError(f"weight_scale holds {len(nan)} NaN block scale(s), e.g. at row {nan[0][0]}, block {nan[0][1]}")
  gs = np.asarray(weight_global_scale, np.float32)
  if gs.size != 1 or not np.isfinite(gs).all() or not (gs > 0).all():
    raise ValueError(f"weight_global_scale must be one finite value > 0, got {gs.tolist()}")
  gs = gs.reshape(())
  low = weight_packed & 0xF
  high = weight_packed >> 4
  codes = np.empty((n, k), np.uint8)
  codes[:, 0::2] = low
  codes[:, 1::2] = high
  packed = _packing.pack_nibbles(jnp.asarray(codes.T))
  return NVFP4Tensor(packed, jnp.asarray(weight_scale.T), jnp.asarray(gs), (k, n))

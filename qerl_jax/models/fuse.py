"""Fused projections: q/k/v and gate/up stored as one column-concatenated matrix each.

A decode step multiplies a handful of rows by every weight, so each linear is one
small, launch- and latency-bound kernel. Storing ``[W_q | W_k | W_v]`` and
``[W_gate | W_up]`` as single matrices (as vLLM's ``qkv_proj`` / ``gate_up_proj``
do) turns five kernels a layer into two; the decoder splits the product back into
its parts and adds each part's LoRA delta (:func:`qerl_jax.models.layers.fused_linear`: per part, or
on the large-M bf16 route as one block-diagonal adapter of the parts), so the LoRA tree, AQN and
every result are unchanged.

NVFP4 keeps one global scale per matrix, so the parts must share it: quantize the
fused float matrices (``quantize_base(fuse_projections(float_base))``), or load a
checkpoint with ``hf.load_pretrained(..., share_fused_global_scale=True)`` and
fuse after loading. :func:`unfuse_projections` splits a fused tree back into the seven
separate matrices (exactly: the columns are only regrouped); the Hugging Face export and
``lora.save_merged_hf`` call it.

:func:`fuse_adapter` gives a LoRA tree the same grouping for sampling: the parts' ``A``
factors side by side and their ``B`` factors as one block-diagonal matrix, so a fused
projection's adapter costs two small matmuls a step instead of two per part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import nf4, nvfp4

# (group, fused name) -> the parts, in column order.
FUSED = {("attn", "qkv"): ("q", "k", "v"), ("mlp", "gate_up"): ("gate", "up")}


def is_fused(base: dict) -> bool:
  """True when ``base`` stores fused projections (``attn/qkv`` and ``mlp/gate_up``)."""
  return all(name in base["layers"][group] for group, name in FUSED)


def fuse_projections(base: dict) -> dict:
  """Returns ``base`` with q/k/v and gate/up (and q/k/v biases) concatenated along the output axis.

  Every leaf keeps its leading (layer) dims; ``attn/qkv`` is ``[L, D, q_dim + 2 kv_dim]``,
  ``mlp/gate_up`` is ``[L, D, 2 I]`` (float arrays, NVFP4Tensor or NF4Tensor, as the parts).
  The forward pass gives the same results with the fused tree (tested), with one matmul
  where there were three (attention) and two (MLP).

  Args:
    base: a base tree (``models.init_params`` / ``hf.load_pretrained`` layout).

  Returns:
    A new base tree; ``base`` is not modified.

  Raises:
    ValueError: already fused; parts of different formats; NVFP4 parts whose global
      scales differ (or are traced, so cannot be compared: call this outside ``jit``);
      only some of q/k/v carry a bias.
  """
  if any(name in base["layers"][group] for group, name in FUSED):
    raise ValueError("fuse_projections: the base is already fused (has attn/qkv or mlp/gate_up)")
  lay = dict(base["layers"])
  for (group, fused_name), parts in FUSED.items():
    g = dict(lay[group])
    g[fused_name] = _concat([g.pop(p) for p in parts], f"{group}/{'+'.join(parts)}")
    biases = [p + "_bias" for p in parts if p + "_bias" in g]
    if biases:
      if len(biases) != len(parts):
        raise ValueError(f"fuse_projections: only {biases} of {group}/{parts} have biases")
      g[fused_name + "_bias"] = jnp.concatenate([g.pop(b) for b in biases], axis=-1)
    lay[group] = g
  return {**base, "layers": lay}


def part_sizes(cfg) -> dict:
  """``{(group, fused name): ((part, columns), ...)}`` for a ``ModelConfig``: q/k/v are
  ``q_dim, kv_dim, kv_dim`` wide, gate/up ``intermediate_size`` each."""
  return {("attn", "qkv"): (("q", cfg.q_dim), ("k", cfg.kv_dim), ("v", cfg.kv_dim)),
          ("mlp", "gate_up"): (("gate", cfg.intermediate_size), ("up", cfg.intermediate_size))}


def unfuse_projections(base: dict, cfg) -> dict:
  """The inverse of :func:`fuse_projections`: q/k/v and gate/up (and biases) as separate matrices.

  The parts are column slices of the fused tensors (NVFP4 parts keep the shared global scale),
  so ``unfuse_projections(fuse_projections(b), cfg)`` equals ``b`` bit for bit when ``b``'s
  NVFP4 parts already shared one global scale.

  Args:
    base: a fused base tree (:func:`is_fused`).
    cfg: its ``ModelConfig`` (the part widths: q_dim, kv_dim, intermediate_size).

  Returns:
    A new base tree with ``attn/{q,k,v}``, ``mlp/{gate,up}`` (``[L, K, part]``) and, where the
    fused tree had ``qkv_bias``, ``attn/{q,k,v}_bias``.

  Raises:
    ValueError: ``base`` is not fused, or a fused matrix's width is not the sum of ``cfg``'s
      part widths (names both).
  """
  if not is_fused(base):
    raise ValueError("unfuse_projections: the base has no fused projections (attn/qkv, mlp/gate_up)")
  lay = dict(base["layers"])
  for (group, fused_name), parts in part_sizes(cfg).items():
    g = dict(lay[group])
    w = g.pop(fused_name)
    bias = g.pop(fused_name + "_bias", None)
    width = w.shape[-1]
    if width != sum(n for _, n in parts):
      raise ValueError(f"unfuse_projections: {group}/{fused_name} has {width} columns but the config's parts "
                       f"{dict(parts)} add up to {sum(n for _, n in parts)}")
    start = 0
    for name, size in parts:
      g[name] = _columns(w, start, size)
      if bias is not None:
        g[name + "_bias"] = bias[..., start:start + size]
      start += size
    lay[group] = g
  return {**base, "layers": lay}


def _columns(w, start: int, size: int):
  cols = slice(start, start + size)
  if isinstance(w, nvfp4.NVFP4Tensor):
    if start % 2 or size % 2:  # decode-order blocks pair columns 2c, 2c + 1
      w = nvfp4.to_standard_order(w)
    return nvfp4.NVFP4Tensor(w.packed[..., cols], w.block_scale[..., cols], w.global_scale,
                             shape=(w.shape[0], size), code_order=w.code_order)
  if isinstance(w, nf4.NF4Tensor):
    return nf4.NF4Tensor(w.packed[..., cols], w.block_scale[..., cols], shape=(w.shape[0], size))
  return w[..., cols]


def _concat(ws: list, what: str):
  if all(isinstance(w, nvfp4.NVFP4Tensor) for w in ws):
    try:
      scales = [np.asarray(w.global_scale) for w in ws]
    except jax.errors.TracerArrayConversionError:
      raise ValueError(f"fuse_projections: {what} global scales are traced; call it outside jit") from None
    if any(not np.array_equal(scales[0], s) for s in scales[1:]):
      raise ValueError(
          f"fuse_projections: the NVFP4 parts of {what} have different global scales; quantize the fused "
          "float matrices instead (quantize_base(fuse_projections(float_base))) or load with "
          "hf.load_pretrained(..., share_fused_global_scale=True)")
    if len({w.code_order for w in ws}) > 1:
      ws = [nvfp4.to_standard_order(w) for w in ws]
    return nvfp4.NVFP4Tensor(jnp.concatenate([w.packed for w in ws], axis=-1),
                             jnp.concatenate([w.block_scale for w in ws], axis=-1), ws[0].global_scale,
                             shape=(ws[0].shape[0], sum(w.shape[1] for w in ws)), code_order=ws[0].code_order)
  if all(isinstance(w, nf4.NF4Tensor) for w in ws):
    return nf4.NF4Tensor(jnp.concatenate([w.packed for w in ws], axis=-1),
                         jnp.concatenate([w.block_scale for w in ws], axis=-1),
                         shape=(ws[0].shape[0], sum(w.shape[1] for w in ws)))
  if all(hasattr(w, "dtype") and jnp.issubdtype(w.dtype, jnp.floating) for w in ws):
    if len({w.dtype for w in ws}) != 1:
      raise ValueError(f"fuse_projections: {what} parts have different dtypes {[str(w.dtype) for w in ws]}")
    return jnp.concatenate(ws, axis=-1)
  raise ValueError(f"fuse_projections: {what} parts mix formats {[type(w).__name__ for w in ws]}")


def fuse_adapter(lora, cfg, dtype=None):
  """A LoRA tree regrouped like a fused base: one adapter for q/k/v and one for gate/up.

  For a fused group with parts ``i`` of widths ``n_i`` (:func:`part_sizes`) that carry
  adapters ``A_i [L, K, r_i]``, ``B_i [L, r_i, n_i]``, the fused adapter is
  ``A = [A_1 | A_2 | ...]`` ``[L, K, sum r_i]`` and ``B`` ``[L, sum r_i, sum n_i]``, block
  diagonal: rows of ``B_i`` sit over part ``i``'s output columns and every other entry is
  exactly 0. Then ``(x @ A) @ B`` restricted to part ``i``'s columns is ``(x @ A_i) @ B_i``
  (LoRA, Hu et al. 2021), so :func:`qerl_jax.models.layers.fused_linear` applies it to the
  whole fused output before splitting, and the model's results do not change (up to float32
  summation order). Parts without an adapter get zero columns in ``B``. ``o``, ``down`` and the
  trainable norms are kept as they are.

  The sampler calls this once per rollout, outside its decode loop (with ``dtype`` the compute
  dtype, so the per-step casts of the float32 factors disappear too); the trainer's forward
  keeps the per-part tree, whose gradients it needs.

  Args:
    lora: an adapter tree (:mod:`qerl_jax.models` layout; ``{"layers": {...}}``), or None.
    cfg: the ``ModelConfig`` (the part widths).
    dtype: cast every ``a`` / ``b`` factor to this dtype (e.g. ``jnp.bfloat16``); None keeps
      the dtypes (the parts of a group must then share one).

  Returns:
    A new tree with ``attn/qkv`` and ``mlp/gate_up`` adapters in place of the parts (groups
    with no adapter on any part are left out), or None when ``lora`` is None.

  Raises:
    ValueError: the tree already has a fused adapter, or a part's ``b`` width differs from its
      ``cfg`` width, or its ``a`` / ``b`` ranks or leading dims disagree (names the part).
  """
  if lora is None:
    return None
  if dtype is not None:
    lora = cast_adapter(lora, dtype)
  lay = dict(lora.get("layers", {}))
  for (group, fused_name), parts in part_sizes(cfg).items():
    g = dict(lay.get(group, {}))
    if fused_name in g:
      raise ValueError(f"fuse_adapter: the adapter already has {group}/{fused_name}")
    if not any(name in g for name, _ in parts):
      continue
    g[fused_name] = block_diagonal([(f"{group}/{name}", g.pop(name, None), size) for name, size in parts],
                                   "fuse_adapter")
    lay[group] = g
  return {**lora, "layers": lay}


def block_diagonal(parts, caller: str) -> dict:
  """Adapters of the parts of a fused matrix as one adapter of the fused output (LoRA, Hu et al. 2021):
  ``A = [A_1 | A_2 | ...]`` ``[..., K, sum r_i]`` and ``B`` ``[..., sum r_i, sum n_i]`` block diagonal, the rows of
  ``B_i`` over part ``i``'s columns and every other entry exactly 0, so that ``(x @ A) @ B`` restricted to part
  ``i``'s columns is ``(x @ A_i) @ B_i``. Parts without an adapter get zero columns.

  Args:
    parts: ``(name, adapter or None, n_i)`` per part, in column order; an adapter is ``{"a": [..., K, r_i],
      "b": [..., r_i, n_i]}`` (the same leading dims, if any). At least one adapter.
    caller: the name the errors begin with.

  Returns:
    ``{"a": ..., "b": ...}`` as above.

  Raises:
    ValueError: a part's ``b`` width differs from ``n_i``, or its ``a`` / ``b`` ranks or leading dims disagree
      (names the part).
  """
  total = sum(size for _, _, size in parts)
  a_parts, b_parts, col = [], [], 0
  for name, ad, size in parts:
    if ad is not None:
      a, b = ad["a"], ad["b"]
      if b.shape[-1] != size or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"{caller}: {name} has a {tuple(a.shape)}, b {tuple(b.shape)}; expected "
                         f"a [..., K, r] and b [..., r, {size}] with the same leading dims")
      a_parts.append(a)
      b_parts.append(jnp.pad(b, [(0, 0)] * (b.ndim - 1) + [(col, total - col - size)]))
    col += size
  return {"a": jnp.concatenate(a_parts, axis=-1), "b": jnp.concatenate(b_parts, axis=-2)}


def cast_adapter(lora, dtype):
  """``lora`` with every linear's ``a`` / ``b`` factor cast to ``dtype`` (the trainable norms
  are kept as they are), or None when ``lora`` is None; the sampler casts once per rollout.

  Args:
    lora: an adapter tree (:mod:`qerl_jax.models` layout), fused or not.
    dtype: e.g. ``jnp.bfloat16``.

  Returns:
    A new tree; ``lora`` is not modified.
  """
  if lora is None:
    return None
  lay = dict(lora.get("layers", {}))
  for group in ("attn", "mlp"):
    if group in lay:
      lay[group] = {name: {k: v.astype(dtype) for k, v in ad.items()} for name, ad in lay[group].items()}
  return {**lora, "layers": lay}

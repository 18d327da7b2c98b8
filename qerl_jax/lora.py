"""LoRA adapters on the frozen (4-bit or bf16) decoder, and PEFT import/export.

A LoRA adapter (Hu et al., "LoRA: Low-Rank Adaptation of Large Language
Models", 2021) adds a low-rank update to a frozen linear ``y = x @ W``::

    y = x @ W + scale * (x @ A) @ B,   A: [K, r],  B: [r, N]

with ``scale = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` under rsLoRA
(Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with
LoRA", 2023). ``W`` stays in whatever format it has (NVFP4, NF4, bf16); only
``A`` and ``B`` (and optionally the RMSNorm scales) are trained.

The LoRA tree follows the model contract (stacked over a leading layer axis L)::

    lora = {"layers": {"attn": {"q": {"a": [L, K, r], "b": [L, r, N]}, ...},
                       "mlp":  {"gate": {...}, "up": {...}, "down": {...}},
                       # only with LoRAConfig.train_norms:
                       "input_norm": f32 [L, D], "post_attn_norm": f32 [L, D]}}

Only targeted modules appear. ``scale`` is static config, not in the tree.

PEFT layout (peft 0.21): ``lora_A.weight`` is ``[r, K]`` (= ``A.T``) and
``lora_B.weight`` is ``[N, r]`` (= ``B.T``), under keys like
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``; trainable
norms travel as ``modules_to_save`` (``...layers.{i}.input_layernorm.weight``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax import hf, nf4, nvfp4

ATTN_MODULES = ("q", "k", "v", "o")
MLP_MODULES = ("gate", "up", "down")
ALL_MODULES = ATTN_MODULES + MLP_MODULES
NORM_NAMES = ("input_norm", "post_attn_norm")

# Our module names -> Hugging Face / PEFT module names (one source of truth: qerl_jax.hf).
_HF_MODULE = {name: hf_name for (_, name), hf_name in hf.HF_LINEARS.items()}
_HF_NORM = {name: hf_name.removesuffix(".weight") for name, hf_name in hf.HF_NORMS.items()}
_PEFT_PREFIX = "base_model.model.model.layers"


def _group(module: str) -> str:
  return "attn" if module in ATTN_MODULES else "mlp"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Static LoRA configuration (hashable: usable as a ``jax.jit`` static arg).

  Attributes:
    r: rank (> 0).
    lora_alpha: the alpha of ``scale = alpha / r`` (finite, > 0).
    use_rslora: use ``scale = alpha / sqrt(r)`` (rsLoRA) instead.
    target_modules: subset of ``("q", "k", "v", "o", "gate", "up", "down")``;
      a list is accepted and stored as a tuple in canonical order.
    train_norms: also train the attention-input and MLP-input RMSNorm scales
      (QeRL's scripts do); :func:`init_lora` then copies them from the base
      into the LoRA tree, where they replace the base ones.
  """

  r: int = 32
  lora_alpha: float = 32.0  # scale 1 at r = 32, as QeRL (and the trainer's config)
  use_rslora: bool = False
  target_modules: tuple[str, ...] = ALL_MODULES
  train_norms: bool = False

  def __post_init__(self):
    if isinstance(self.target_modules, str):
      raise TypeError(f"target_modules={self.target_modules!r} must be a sequence of names, not a string")
    mods = tuple(self.target_modules)
    bad = [m for m in mods if m not in ALL_MODULES]
    if bad:
      raise ValueError(f"target_modules has unknown names {bad}; expected a subset of {ALL_MODULES}")
    if not mods:
      raise ValueError("target_modules is empty")
    object.__setattr__(self, "target_modules", tuple(m for m in ALL_MODULES if m in mods))
    if int(self.r) != self.r or self.r <= 0:
      raise ValueError(f"LoRAConfig.r={self.r}; must be a positive integer")
    if not (self.lora_alpha > 0 and math.isfinite(self.lora_alpha)):  # inf * (B = 0) made the first forward NaN
      raise ValueError(f"LoRAConfig.lora_alpha={self.lora_alpha}; must be a finite number > 0")

  @property
  def scale(self) -> float:
    """Same as :func:`scale` (the model's ``forward(lora_cfg=...)`` reads this)."""
    return scale(self)


def scale(cfg: LoRAConfig) -> float:
  """The LoRA scale: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA (PEFT's convention)."""
  if cfg.use_rslora:
    return float(cfg.lora_alpha) / math.sqrt(cfg.r)
  return float(cfg.lora_alpha) / cfg.r


def module_shapes(model_cfg) -> dict[str, tuple[int, int]]:
  """Logical ``(K, N)`` of each linear for a decoder config (x @ W layout).

  Args:
    model_cfg: the model's ``ModelConfig`` (needs hidden_size,
      intermediate_size, num_heads, num_kv_heads, head_dim).

  Returns:
    ``{"q": (D, H*hd), "k": (D, KV*hd), "v": (D, KV*hd), "o": (H*hd, D),
    "gate": (D, I), "up": (D, I), "down": (I, D)}``.

  Raises:
    TypeError: ``model_cfg`` lacks one of those fields.
  """
  try:
    d, i = int(model_cfg.hidden_size), int(model_cfg.intermediate_size)
    q_out = int(model_cfg.num_heads) * int(model_cfg.head_dim)
    kv_out = int(model_cfg.num_kv_heads) * int(model_cfg.head_dim)
  except AttributeError as e:
    raise TypeError(f"model_cfg lacks a field LoRA needs: {e}") from None
  return {"q": (d, q_out), "k": (d, kv_out), "v": (d, kv_out), "o": (q_out, d),
          "gate": (d, i), "up": (d, i), "down": (i, d)}


def init_lora(key: jax.Array, model_cfg, lora_cfg: LoRAConfig, base: Optional[Mapping] = None,
              *, param_dtype=jnp.float32) -> dict:
  """A fresh adapter: A Kaiming-uniform as PEFT initialises it, B zeros.

  PEFT's ``reset_lora_parameters`` calls ``kaiming_uniform_(A, a=sqrt(5))`` on
  its ``[r, K]`` weight, whose fan-in is K: gain ``sqrt(2 / (1 + 5))``, bound
  ``gain * sqrt(3 / K) = 1 / sqrt(K)``. Here ``A`` is ``[K, r]`` and is drawn
  from ``U(-1/sqrt(K), 1/sqrt(K))``, the same distribution. ``B = 0`` so the
  adapter's contribution is exactly 0 and the model's output is unchanged bit
  for bit.

  Each module's key is ``fold_in(key, index of the module in ALL_MODULES)``
  and each layer's ``fold_in`` of that, so changing ``target_modules`` or the
  layer count does not change the other modules' draws.

  Args:
    key: PRNG key.
    model_cfg: the model's ``ModelConfig`` (num_layers and the fields of
      :func:`module_shapes`).
    lora_cfg: :class:`LoRAConfig`.
    base: the frozen parameter tree; required when ``lora_cfg.train_norms``
      (the norms are copied from ``base["layers"]``).
    param_dtype: dtype of the trainable arrays (float32 by default: optimizer
      master weights; the forward casts to bf16 for the matmuls).

  Returns:
    The LoRA tree of the module docstring; A ``[L, K, r]``, B ``[L, r, N]``,
    norms ``[L, D]``, all ``param_dtype``.

  Raises:
    ValueError: ``train_norms`` without ``base``, or base norms of the wrong shape.
  """
  num_layers = int(model_cfg.num_layers)
  shapes = module_shapes(model_cfg)
  r = int(lora_cfg.r)
  layers: dict[str, Any] = {}
  for m in lora_cfg.target_modules:
    k_in, n_out = shapes[m]
    mkey = jax.random.fold_in(key, ALL_MODULES.index(m))
    bound = 1.0 / math.sqrt(k_in)
    a = jax.vmap(lambda l: jax.random.uniform(jax.random.fold_in(mkey, l), (k_in, r), jnp.float32,
                                              -bound, bound))(jnp.arange(num_layers, dtype=jnp.uint32))
    layers.setdefault(_group(m), {})[m] = {
        "a": a.astype(param_dtype),
        "b": jnp.zeros((num_layers, r, n_out), param_dtype),
    }
  if lora_cfg.train_norms:
    if base is None:
      raise ValueError("LoRAConfig.train_norms=True needs `base` to copy the RMSNorm scales from")
    want = (num_layers, int(model_cfg.hidden_size))
    for name in NORM_NAMES:
      w = base["layers"][name]
      if tuple(w.shape) != want:
        raise ValueError(f"base['layers'][{name!r}] has shape {tuple(w.shape)}; expected {want}")
      layers[name] = jnp.asarray(w, param_dtype)
  return {"layers": layers}


def _dequantize_any(w, dtype):
  if isinstance(w, nvfp4.NVFP4Tensor):
    return nvfp4.dequantize(w, dtype)
  if isinstance(w, nf4.NF4Tensor):
    return nf4.dequantize(w, dtype)
  return None


def merge(base: Mapping, lora: Mapping, lora_cfg: LoRAConfig, *, dequantize_4bit: bool = False,
          dtype=None) -> dict:
  """Fold an adapter into the base weights: ``W' = W + scale * A @ B``.

  The product and the sum are computed in float32 and cast to the weight's
  dtype (or ``dtype``). Trainable norms in ``lora`` replace the base ones
  (cast to the base norm dtype). Untargeted weights are shared, not copied.

  Args:
    base: frozen tree (model contract); targeted W ``[L, K, N]`` arrays, or
      NVFP4/NF4 tensors when ``dequantize_4bit``.
    lora: LoRA tree from :func:`init_lora` / training.
    lora_cfg: the adapter's config (for the scale).
    dequantize_4bit: dequantize 4-bit targeted weights (to float32) before the
      add; the merged weight is then ``dtype`` (bf16 when ``dtype`` is None).
    dtype: output dtype of merged weights (default: the base weight's dtype).

  Returns:
    A new base tree (nested dicts copied, arrays shared where unchanged).

  Raises:
    TypeError: a targeted weight is 4-bit and ``dequantize_4bit`` is False.
    ValueError: shape mismatch between W and A @ B; a base with fused projections.
  """
  from qerl_jax.models import fuse
  if fuse.is_fused(base):
    raise ValueError("merge: the base has fused projections (attn/qkv, mlp/gate_up); split them first with "
                     "models.unfuse_projections(base, model_cfg) (save_merged_hf does this itself)")
  s = scale(lora_cfg)
  out = _copy_dicts(base)
  llayers = lora.get("layers", {})
  for grp in ("attn", "mlp"):
    for m, ab in llayers.get(grp, {}).items():
      w = base["layers"][grp][m]
      wf = _dequantize_any(w, jnp.float32)
      if wf is not None:
        if not dequantize_4bit:
          raise TypeError(f"base weight {grp}.{m} is {type(w).__name__}; pass dequantize_4bit=True to merge into it")
        out_dtype = dtype or jnp.bfloat16
      else:
        wf = jnp.asarray(w, jnp.float32)
        out_dtype = dtype or w.dtype
      a = jnp.asarray(ab["a"], jnp.float32)
      b = jnp.asarray(ab["b"], jnp.float32)
      delta = jnp.einsum("lkr,lrn->lkn", a, b, precision=jax.lax.Precision.HIGHEST)
      if delta.shape != wf.shape:
        raise ValueError(f"{grp}.{m}: A @ B has shape {delta.shape} but W has {wf.shape}")
      out["layers"][grp][m] = (wf + jnp.float32(s) * delta).astype(out_dtype)
  for name in NORM_NAMES:
    if name in llayers:
      out["layers"][name] = jnp.asarray(llayers[name]).astype(base["layers"][name].dtype)
  return out


def _copy_dicts(tree):
  if isinstance(tree, Mapping):
    return {k: _copy_dicts(v) for k, v in tree.items()}
  return tree


# ------------------------------------------------------------------ PEFT ---

def peft_state_dict(lora: Mapping, lora_cfg: LoRAConfig) -> dict[str, np.ndarray]:
  """The adapter as PEFT's flat state dict (numpy, PEFT layout; bf16 leaves widened to float32, float32
  ones as they are).

  Keys: ``base_model.model.model.layers.{i}.{self_attn|mlp}.{m}_proj.lora_A.weight``
  ``[r, K]`` and ``...lora_B.weight`` ``[N, r]``; trainable norms as
  ``...layers.{i}.input_layernorm.weight`` / ``post_attention_layernorm.weight`` ``[D]``.
  """
  sd: dict[str, np.ndarray] = {}
  layers = lora["layers"]
  for m in lora_cfg.target_modules:
    ab = layers[_group(m)][m]
    a, b = _to_numpy(ab["a"]), _to_numpy(ab["b"])
    for i in range(a.shape[0]):
      pre = f"{_PEFT_PREFIX}.{i}.{_HF_MODULE[m]}"
      sd[f"{pre}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
      sd[f"{pre}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
  for name in NORM_NAMES:
    if name in layers:
      w = _to_numpy(layers[name])
      for i in range(w.shape[0]):
        sd[f"{_PEFT_PREFIX}.{i}.{_HF_NORM[name]}.weight"] = np.ascontiguousarray(w[i])
  return sd


def _to_numpy(x) -> np.ndarray:
  x = np.asarray(jax.device_get(x))
  # bf16 is widened to float32 (exact) so the file needs no bf16 support.
  if x.dtype == jnp.bfloat16:
    x = x.astype(np.float32)
  return x


def peft_config_dict(lora_cfg: LoRAConfig, base_model_name_or_path: str) -> dict:
  """PEFT ``adapter_config.json`` contents for this adapter (LoraConfig fields)."""
  modules_to_save = [_HF_NORM[n] for n in NORM_NAMES] if lora_cfg.train_norms else None
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path,
      "r": int(lora_cfg.r),
      "lora_alpha": lora_cfg.lora_alpha,
      "use_rslora": bool(lora_cfg.use_rslora),
      "target_modules": [_HF_MODULE[m].split(".")[1] for m in lora_cfg.target_modules],
      "modules_to_save": modules_to_save,
      "lora_dropout": 0.0,
      "bias": "none",
      "fan_in_fan_out": False,
      "init_lora_weights": True,
      "use_dora": False,
      "inference_mode": True,
      "rank_pattern": {},
      "alpha_pattern": {},
      "layers_to_transform": None,
  }


def save_peft_adapter(path: str, lora: Mapping, model_cfg, lora_cfg: LoRAConfig,
                      base_model_name_or_path: str) -> None:
  """Write ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's format.

  ``peft.PeftModel.from_pretrained(hf_model, path)`` on the matching
  transformers model then reproduces this adapter (verified against peft
  0.21.2 in tests/test_lora.py).

  Args:
    path: output directory (created if missing).
    lora: LoRA tree; arrays are written in their dtype (bf16 as float32).
    model_cfg: the model's ``ModelConfig`` (checked against the tree's shapes).
    lora_cfg: the adapter's config.
    base_model_name_or_path: recorded in the config (hub id or local path).

  Raises:
    ValueError: the tree does not match ``lora_cfg`` / ``model_cfg`` (a targeted
      module missing or of the wrong shape, or a module / norm in the tree that
      ``lora_cfg`` does not list).
  """
  from safetensors.numpy import save_file
  _check_tree(lora, model_cfg, lora_cfg)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(peft_config_dict(lora_cfg, base_model_name_or_path), f, indent=2)
  save_file(peft_state_dict(lora, lora_cfg), os.path.join(path, "adapter_model.safetensors"),
            metadata={"format": "pt"})


def _check_tree(lora, model_cfg, lora_cfg):
  shapes = module_shapes(model_cfg)
  num_layers = int(model_cfg.num_layers)
  layers = lora.get("layers", {}) if isinstance(lora, Mapping) else {}
  for m in lora_cfg.target_modules:
    try:
      ab = layers[_group(m)][m]
    except KeyError:
      raise ValueError(f"lora tree lacks targeted module {_group(m)}.{m}") from None
    k_in, n_out = shapes[m]
    want_a, want_b = (num_layers, k_in, lora_cfg.r), (num_layers, lora_cfg.r, n_out)
    if tuple(ab["a"].shape) != want_a or tuple(ab["b"].shape) != want_b:
      raise ValueError(f"lora {m}: a {tuple(ab['a'].shape)}, b {tuple(ab['b'].shape)}; "
                       f"expected {want_a}, {want_b}")
  if lora_cfg.train_norms and not all(n in layers for n in NORM_NAMES):
    raise ValueError(f"train_norms=True but the lora tree lacks {NORM_NAMES}")
  # The forward and merge() apply every adapter / norm in the tree; an export that follows
  # lora_cfg would silently drop the ones the config does not list.
  extra = [f"{g}.{m}" for g in ("attn", "mlp") for m in layers.get(g, {}) if m not in lora_cfg.target_modules]
  if not lora_cfg.train_norms:
    extra += [n for n in NORM_NAMES if n in layers]
  if extra:
    raise ValueError(f"the lora tree has {extra}, which lora_cfg (target_modules={lora_cfg.target_modules}, "
                     f"train_norms={lora_cfg.train_norms}) does not list; they would be left out")


_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\."
    r"(?:(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_([AB])(?:\.default)?\.weight"
    r"|(input_layernorm|post_attention_layernorm)\.weight)$")


def load_peft_adapter(path: str, *, dtype=jnp.float32) -> tuple[dict, LoRAConfig]:
  """Read a PEFT LoRA adapter directory into ``(lora tree, LoRAConfig)``.

  Supports plain LoRA on q/k/v/o/gate/up/down projections of a Llama/Qwen-style
  decoder, optional ``modules_to_save`` of the two per-layer norms, global
  ``r``/``lora_alpha``, and ``use_rslora``.

  Args:
    path: directory with ``adapter_config.json`` and ``adapter_model.safetensors``.
    dtype: dtype of the returned arrays.

  Returns:
    ``(lora, lora_cfg)`` with A ``[L, K, r]``, B ``[L, r, N]``.

  Raises:
    FileNotFoundError: missing files.
    ValueError: a feature this library does not model (DoRA, rank/alpha
      patterns, layer subsets, biases, fan_in_fan_out, regex target_modules,
      other modules_to_save, QA-LoRA, layer_replication, aLoRA, an
      initialisation that rewrote the base: PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA),
      unknown / missing keys, or a weight whose rank differs from the
      config's ``r`` or whose shape differs between layers.
  """
  from safetensors.numpy import load_file
  cfg_path = os.path.join(path, "adapter_config.json")
  st_path = os.path.join(path, "adapter_model.safetensors")
  for p in (cfg_path, st_path):
    if not os.path.exists(p):
      raise FileNotFoundError(f"PEFT adapter file not found: {p}")
  with open(cfg_path) as f:
    c = json.load(f)
  if c.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{cfg_path}: peft_type={c.get('peft_type')!r}; only LORA is supported")
  for field, ok in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
    if c.get(field, ok) != ok:
      raise ValueError(f"{cfg_path}: {field}={c.get(field)!r} is not supported (need {ok!r})")
  for field in ("rank_pattern", "alpha_pattern"):
    if c.get(field):
      raise ValueError(f"{cfg_path}: {field}={c[field]!r} is not supported (one r/alpha for all modules)")
  if c.get("layers_to_transform") is not None:
    raise ValueError(f"{cfg_path}: layers_to_transform={c['layers_to_transform']!r} is not supported")
  # Fields that change what the adapter computes (QA-LoRA pools the input, layer_replication
  # duplicates layers, aLoRA applies the adapter only after invocation tokens).
  for field in ("use_qalora", "layer_replication", "alora_invocation_tokens"):
    if c.get(field):
      raise ValueError(f"{cfg_path}: {field}={c[field]!r} is not supported")
  # PiSSA / OLoRA / CorDA / LoftQ / LoRA-GA rewrite the base weights at init; such an adapter
  # only reproduces its model on that residual base, not on the original one loaded here.
  init = c.get("init_lora_weights", True)
  if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "loftq", "lora_ga")):
    raise ValueError(f"{cfg_path}: init_lora_weights={init!r} modified the base weights; save the adapter "
                     "converted to plain LoRA (PEFT's path_initial_model_for_weight_conversion) or merged")
  tm = c.get("target_modules")
  if not isinstance(tm, list):
    raise ValueError(f"{cfg_path}: target_modules={tm!r}; need an explicit list of *_proj names")
  hf_to_ours = {v.split(".")[1]: k for k, v in _HF_MODULE.items()}
  bad = [t for t in tm if t not in hf_to_ours]
  if bad:
    raise ValueError(f"{cfg_path}: target_modules {bad} are not q/k/v/o/gate/up/down_proj")
  mts = c.get("modules_to_save") or []
  if set(mts) - set(_HF_NORM.values()):
    raise ValueError(f"{cfg_path}: modules_to_save={mts}; only the per-layer norms are supported")
  train_norms = bool(mts)
  if train_norms and set(mts) != set(_HF_NORM.values()):
    raise ValueError(f"{cfg_path}: modules_to_save={mts}; need both {sorted(_HF_NORM.values())}")
  lora_cfg = LoRAConfig(r=int(c["r"]), lora_alpha=c["lora_alpha"], use_rslora=bool(c.get("use_rslora", False)),
                        target_modules=tuple(hf_to_ours[t] for t in tm), train_norms=train_norms)

  sd = load_file(st_path)
  per: dict[tuple, dict[int, np.ndarray]] = {}
  hf_norm_to_ours = {v: k for k, v in _HF_NORM.items()}
  for key, arr in sd.items():
    mt = _KEY_RE.match(key)
    if mt is None:
      raise ValueError(f"{st_path}: unexpected key {key!r}")
    i = int(mt.group(1))
    if mt.group(5):
      slot = ("norm", hf_norm_to_ours[mt.group(5)])
    else:
      m, ab = mt.group(3), mt.group(4)
      if m not in lora_cfg.target_modules:
        raise ValueError(f"{st_path}: key {key!r} is for a module not in target_modules")
      slot = (m, ab)
    per.setdefault(slot, {})[i] = arr
  if not per:
    raise ValueError(f"{st_path}: no LoRA weights found")
  num_layers = 1 + max(i for d in per.values() for i in d)
  layers: dict[str, Any] = {}

  def stack(slot, transpose):
    d = per.get(slot)
    if d is None or sorted(d) != list(range(num_layers)):
      have = sorted(d) if d else []
      raise ValueError(f"{st_path}: {slot} present for layers {have}; need 0..{num_layers - 1}")
    # PEFT layout: lora_A [r, K], lora_B [N, r], norms [D]; one shape for all layers, and the
    # rank must be the config's r (the scale alpha/r or alpha/sqrt(r) is computed from it).
    r, want_ndim = lora_cfg.r, (1 if slot[0] == "norm" else 2)
    for i in range(num_layers):
      shp = tuple(d[i].shape)
      bad_rank = want_ndim == 2 and len(shp) == 2 and (shp[0] if slot[1] == "A" else shp[1]) != r
      if len(shp) != want_ndim or shp != tuple(d[0].shape) or bad_rank:
        what = "a 1-D norm [D]" if want_ndim == 1 else (f"lora_A [r={r}, K]" if slot[1] == "A"
                                                         else f"lora_B [N, r={r}]")
        raise ValueError(f"{st_path}: {slot} layer {i} has shape {shp} (layer 0: {tuple(d[0].shape)}); "
                         f"expected {what} with r from {cfg_path}, the same in every layer")
    return jnp.asarray(np.stack([d[i].T if transpose else d[i] for i in range(num_layers)]), dtype)

  for m in lora_cfg.target_modules:
    layers.setdefault(_group(m), {})[m] = {"a": stack((m, "A"), True), "b": stack((m, "B"), True)}
  for name in NORM_NAMES:
    if train_norms:
      layers[name] = stack(("norm", name), False)
    elif ("norm", name) in per:
      raise ValueError(f"{st_path}: has {_HF_NORM[name]} weights but {cfg_path} lists no "
                       "modules_to_save; they would be dropped")
  return {"layers": layers}, lora_cfg


def save_merged_hf(folder: str, model_cfg, base: Mapping, lora: Mapping, lora_cfg: LoRAConfig, *,
                   dtype=None, **save_kwargs) -> None:
  """Merge the adapter into the base and write a Hugging Face checkpoint.

  4-bit weights are dequantized (float32), ``scale * A @ B`` is added in
  float32 and the result is written in ``dtype`` (bf16 by default) by
  :func:`qerl_jax.hf.save_pretrained`; transformers loads the folder with no
  PEFT involved.

  Args:
    folder: output directory.
    model_cfg: the model's ``ModelConfig``.
    base, lora, lora_cfg: as in :func:`merge` (a base with fused projections is split first).
    dtype: checkpoint dtype (a NumPy/ml_dtypes dtype; default bfloat16).
    **save_kwargs: passed to ``hf.save_pretrained`` (tokenizer, generation_config, ...).

  Raises:
    ValueError: ``lora`` does not match ``lora_cfg`` and the model's shapes (as :func:`merge`).
  """
  import ml_dtypes
  dtype = ml_dtypes.bfloat16 if dtype is None else dtype
  _check_tree(lora, model_cfg, lora_cfg)
  from qerl_jax.models import fuse
  if fuse.is_fused(base):  # the trainer's default base: split q/k/v and gate/up back (exact)
    base = fuse.unfuse_projections(base, model_cfg)
  merged = merge(base, lora, lora_cfg, dequantize_4bit=True, dtype=jnp.float32)
  hf.save_pretrained(folder, model_cfg, merged, dtype=dtype, **save_kwargs)

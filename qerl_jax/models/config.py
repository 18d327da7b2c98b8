"""The decoder's static configuration, read from a Hugging Face ``config.json``.

One decoder family covers Qwen2/Qwen2.5 (q/k/v biases), Qwen3 (per-head RMSNorm
on q and k, no biases) and Llama 3 (``rope_scaling`` of type ``llama3``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import numpy as np

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
_MODEL_TYPE_TO_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "llama": "LlamaForCausalLM"}
_SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and constants of a decoder; frozen and hashable (a valid jit static arg).

  Fields (units: counts of features/heads/tokens unless stated):
    architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
    vocab_size, hidden_size (D), intermediate_size (F), num_layers (L),
    num_heads (H, query heads), num_kv_heads (Hkv, GQA key/value heads),
    head_dim (hd).
    rms_norm_eps: epsilon inside RMSNorm's square root.
    rope_theta: RoPE base (HF default 10000.0 only when the key is absent).
    rope_scaling: ``None`` or a sorted tuple of ``(key, value)`` pairs (hashable
      form of HF's ``rope_scaling`` dict, ``rope_type`` in ``{"linear", "llama3"}``).
    tie_word_embeddings: lm_head is the transposed input embedding.
    attention_bias: q/k/v projections carry biases (Qwen2).
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    max_position_embeddings: longest context the checkpoint was trained for.
    dtype: compute dtype name, ``"bfloat16"`` (real runs), ``"float32"``
      (parity tests) or ``"float16"``. Weights are cast to it inside each matmul; matmuls
      accumulate in float32; softmax, RMSNorm and log-softmax run in float32.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: Optional[tuple] = None
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 32768
  architecture: str = "Qwen2ForCausalLM"
  dtype: str = "bfloat16"

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"unsupported architecture {self.architecture!r}; supported: "
                       f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads}) for grouped-query attention")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if self.dtype not in ("bfloat16", "float32", "float16"):
      raise ValueError(f"ModelConfig.dtype must be 'bfloat16', 'float32' or 'float16', got {self.dtype!r}")
    if self.rope_scaling is not None:
      rt = dict(self.rope_scaling).get("rope_type", "default")
      if rt not in _SUPPORTED_ROPE:
        raise ValueError(f"unsupported rope_scaling type {rt!r}; supported: {_SUPPORTED_ROPE}")
      need = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
      missing = [k for k in need.get(rt, ()) if dict(self.rope_scaling).get(k) is None]
      if missing:  # (found here, not as a KeyError at the first forward)
        raise ValueError(f"rope_scaling of type {rt!r} lacks {missing}; got {dict(self.rope_scaling)}")

  @property
  def rope_scaling_dict(self) -> Optional[dict]:
    """``rope_scaling`` as a plain dict (None when unset)."""
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  @property
  def q_dim(self) -> int:
    """Width of the query projection's output: ``num_heads * head_dim``."""
    return self.num_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    """Width of the key (and of the value) projection's output: ``num_kv_heads * head_dim``."""
    return self.num_kv_heads * self.head_dim

  def replace(self, **kw) -> "ModelConfig":
    """``dataclasses.replace`` shortcut, e.g. ``cfg.replace(dtype="float32")``."""
    return dataclasses.replace(self, **kw)

  def linear_shapes(self) -> dict:
    """``{(group, name): (K, N)}`` for every linear of one layer (x @ W layout)."""
    d, f = self.hidden_size, self.intermediate_size
    return {("attn", "q"): (d, self.q_dim), ("attn", "k"): (d, self.kv_dim),
            ("attn", "v"): (d, self.kv_dim), ("attn", "o"): (self.q_dim, d),
            ("mlp", "gate"): (d, f), ("mlp", "up"): (d, f), ("mlp", "down"): (f, d)}

  @classmethod
  def from_hf(cls, config: Mapping[str, Any], *, dtype: str = "bfloat16") -> "ModelConfig":
    """Builds a config from a Hugging Face ``config.json`` dict.

    Reads both the transformers<5 keys (``rope_theta``, ``rope_scaling``) and the
    transformers>=5 key ``rope_parameters``; ``rope_theta`` defaults to 10000.0
    only when no key gives it. ``head_dim`` defaults to hidden_size / heads.

    Args:
      config: the parsed ``config.json``.
      dtype: compute dtype name (see the class docstring).

    Raises:
      ValueError: unsupported architecture (the message lists the supported
        ones), activation other than SiLU, sliding-window attention turned on,
        MLP or output-projection biases, an unsupported RoPE scaling type, or a
        missing required key.
    """
    config = dict(config)
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
      arch = _MODEL_TYPE_TO_ARCH.get(config.get("model_type"))
    if arch is None:
      raise ValueError(f"unsupported architecture {archs or config.get('model_type')!r}; "
                       f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def req(key):
      if key not in config or config[key] is None:
        raise ValueError(f"config.json has no {key!r} (needed for {arch})")
      return config[key]

    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
      raise ValueError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if config.get("use_sliding_window", False):
      raise ValueError("use_sliding_window=True is not supported (full causal attention only)")
    if config.get("mlp_bias", False):
      raise ValueError("mlp_bias=True is not supported")
    if arch == "Qwen2ForCausalLM":
      attention_bias = True  # Qwen2 hard-codes q/k/v biases (no o bias)
    else:
      if config.get("attention_bias", False):
        raise ValueError(f"attention_bias=True for {arch} (bias on o_proj too) is not supported")
      attention_bias = False

    rope_params = config.get("rope_parameters") or {}
    # transformers 5 may nest per-attention-type parameters; take full attention's.
    if "full_attention" in rope_params and isinstance(rope_params["full_attention"], dict):
      rope_params = rope_params["full_attention"]
    rope_theta = config.get("rope_theta", rope_params.get("rope_theta"))
    rope_theta = 10000.0 if rope_theta is None else float(rope_theta)
    scaling = config.get("rope_scaling")
    if scaling is None and rope_params:
      scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if scaling is not None:
      scaling = dict(scaling)
      if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
      scaling.pop("type", None)
      if scaling.get("rope_type", "default") == "default":
        scaling = None
      else:
        scaling = tuple(sorted((k, _hashable(v)) for k, v in scaling.items()))

    hidden = int(req("hidden_size"))
    heads = int(req("num_attention_heads"))
    # transformers' default when config.json has none: Qwen3Config's is 128, the others' hidden / heads
    head_dim = config.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else hidden // heads)
    kv_heads = config.get("num_key_value_heads") or heads
    return cls(
        vocab_size=int(req("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(req("intermediate_size")),
        num_layers=int(req("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        architecture=arch,
        dtype=dtype,
    )

  def to_hf(self) -> dict:
    """A ``config.json`` dict transformers can load (transformers<5 key names,
    which transformers 5 also reads)."""
    model_type = {v: k for k, v in _MODEL_TYPE_TO_ARCH.items()}[self.architecture]
    out = {
        "architectures": [self.architecture], "model_type": model_type,
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling_dict,
        "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
        "max_position_embeddings": self.max_position_embeddings, "torch_dtype": "bfloat16",
    }
    if self.architecture != "Qwen2ForCausalLM":
      out["attention_bias"] = False
    return out


def _hashable(v):
  if isinstance(v, list):
    return tuple(v)
  if isinstance(v, dict):
    return tuple(sorted(v.items()))
  return v


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """RoPE inverse frequencies, float32 ``[head_dim // 2]`` (radians per position).

  ``theta ** (-2i / head_dim)`` (Su et al. 2021, RoFormer), divided by
  ``factor`` for ``linear`` scaling, and for ``llama3`` scaling smoothly
  interpolated between ``inv_freq / factor`` (wavelengths longer than
  ``original_max_position_embeddings / low_freq_factor``) and ``inv_freq``
  (shorter than ``... / high_freq_factor``), as in Meta's Llama 3.1 reference and
  transformers' ``_compute_llama3_parameters``. Computed in float32 like transformers, except the power
  ``theta ** (2i / head_dim)``: in float64, rounded once to float32 (bit for bit transformers' CPU values for
  Llama 3.2's configs, within one ulp for Qwen's).

  Raises:
    ValueError: a ``rope_scaling`` whose type is neither ``linear`` nor ``llama3`` (checked when the
      :class:`ModelConfig` is made, as are the scaling's required keys).
  """
  dim = cfg.head_dim
  exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  # theta ** exponent in float64, rounded once to float32 (transformers' float32 pow is within about an ulp
  # of that); numpy's float32 power is 1-2 ulps off, which moves RoPE angles by up to ~7e-3 rad at 120k positions.
  power = np.power(np.float64(cfg.rope_theta), exponent.astype(np.float64)).astype(np.float32)
  inv_freq = (np.float32(1.0) / power).astype(np.float32)
  sc = cfg.rope_scaling_dict
  if sc is None:
    return inv_freq
  rt = sc.get("rope_type", "default")
  if rt == "linear":
    return (inv_freq / np.float32(sc["factor"])).astype(np.float32)
  if rt == "llama3":
    factor = np.float32(sc["factor"])
    low = np.float32(sc["low_freq_factor"])
    high = np.float32(sc["high_freq_factor"])
    old_ctx = np.float32(sc["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
  raise ValueError(f"unsupported rope_scaling type {rt!r}")

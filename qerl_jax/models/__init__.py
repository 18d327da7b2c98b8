"""The policy model: one functional decoder for Qwen2/Qwen2.5, Qwen3 and Llama 3.

API summary (all pure functions over plain nested dicts)::

  from qerl_jax import models
  cfg = models.ModelConfig.from_hf(config_json_dict, dtype="bfloat16")   # frozen, hashable: jit static arg
  base = models.init_params(cfg, key)                 # or qerl_jax.hf.load_pretrained(path).base
  base = models.quantize_base(base, "nvfp4")          # every decoder linear -> NVFP4Tensor [L, K, N]
  base = models.to_decode_order(base)                 # optional: codes in the GPU decode kernel's order
  print(models.summarize(base))                       # path, format, shape, bytes of every weight

  # full forward (training / scoring); logits float32 [B, T, V]
  pos = models.positions_from_mask(mask)              # int32 [B, T], cumsum(mask) - 1 (left padding OK)
  logits, _ = models.forward(cfg, base, tokens, pos, attn_mask=mask,
                             lora=lora, lora_cfg=scale_or_obj_with_.scale, norm_noise=noise, remat=False)

  # KV cache: prefill then decode (shared write index; left-pad prompts)
  cache = models.init_cache(cfg, batch, max_len, dtype=jnp.bfloat16)
  #   {"k","v": [L, B, S, Hkv, hd], "mask": bool [B, S], "index": int32 []}
  hidden, cache = models.forward(cfg, base, prompt, pos, attn_mask=mask, cache=cache, return_hidden=True)
  logits_last = models.lm_head_logits(cfg, base, hidden[:, -1])        # f32 [B, V]
  logits, cache = models.forward(cfg, base, next_tok[:, None], last_pos[:, None] + 1, cache=cache)

  # GRPO: log p(tokens[t] | tokens[:t]) and entropy (nats), aligned with tokens, [:, 0] = 0,
  # chunked over T so [B, T, V] f32 logits never exist; differentiable w.r.t. lora; remat on by default
  logprobs, entropy = models.token_logprobs(cfg, base, tokens, pos, attn_mask=mask, lora=lora,
                                            lora_cfg=..., norm_noise=noise, chunk_size=256, temperature=1.0,
                                            attn_chunk=512)   # attn_chunk: query-chunked attention (memory)

Parameter trees:

* base: ``{"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (absent when tied),
  "layers": {"input_norm": [L, D], "post_attn_norm": [L, D],
  "attn": {"q","k","v","o": W, "q_bias"/"k_bias"/"v_bias": [L, N] (Qwen2),
  "q_norm"/"k_norm": [L, hd] (Qwen3)}, "mlp": {"gate","up","down": W}}}``; W is a
  float array ``[L, K, N]`` (x @ W layout, K = in features) or an
  ``NVFP4Tensor`` / ``NF4Tensor`` with leading L. ``fuse_projections(base)`` replaces
  q/k/v (and their biases) with ``attn/qkv`` and gate/up with ``mlp/gate_up``,
  concatenated along N (fewer kernel launches per decode step; same results; the trainer's
  default); ``unfuse_projections(base, cfg)`` splits them back.
* lora: ``{"layers": {"attn": {"q": {"a": [L, K, r], "b": [L, r, N]}, ...}, "mlp": {...},
  optional "input_norm"/"post_attn_norm": [L, D] replacing the base norms}}`` (only
  targeted modules). Output += ``scale * (x @ a) @ b``; ``lora_cfg`` gives ``scale``.
  ``fuse_adapter(lora, cfg)`` regroups it as ``attn/qkv`` and ``mlp/gate_up`` adapters for a
  fused base (``a`` side by side, ``b`` block diagonal; what the sampler runs).
* norm_noise (AQN): ``{"input_norm": f32 [L, D], "post_attn_norm": f32 [L, D]}`` added to
  the RMSNorm weights in float32.

The only weight dispatch is :func:`qerl_jax.models.layers.linear` (and
:func:`~qerl_jax.models.layers.fused_linear` for fused projections; float ->
``jnp.dot`` with float32 accumulation, 4-bit -> ``pallas_kernels.quantized_matmul``).
Hugging Face import/export lives in :mod:`qerl_jax.hf`.
"""

from qerl_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, rope_inv_freq
from qerl_jax.models.decoder import (LINEARS, dequantize_base, dequantizes_linear, forward, init_cache, init_params,
                                     lm_head_logits, logprobs_from_hidden, lora_scale_of,
                                     map_linears, positions_from_mask, quantize_base,
                                     summarize, to_decode_order, token_ids_outside,
                                     token_logprobs)
from qerl_jax.models.fuse import cast_adapter, fuse_adapter, fuse_projections, is_fused, unfuse_projections
from qerl_jax.models.layers import linear, is_quantized

__all__ = [
    "SUPPORTED_ARCHITECTURES", "ModelConfig", "rope_inv_freq", "LINEARS", "dequantize_base", "dequantizes_linear",
    "forward", "init_cache", "init_params", "lm_head_logits", "logprobs_from_hidden",
    "lora_scale_of", "map_linears", "positions_from_mask", "quantize_base", "summarize", "to_decode_order",
    "token_ids_outside", "token_logprobs",
    "linear", "is_quantized", "cast_adapter", "fuse_adapter", "fuse_projections", "is_fused", "unfuse_projections",
]

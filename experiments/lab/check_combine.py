"""Lab (GPU, session 23): decode steps of a small NVFP4 model with decoder.ATTENTION_COMBINE_IN_KERNEL off and on
(the layer end on as by default): logits agree (float32 relative error), and the kernel got counters."""
import jax, jax.numpy as jnp, numpy as np
from qerl_jax import models
from qerl_jax.models import decoder
from pallas_kernels import decode_attention as da
from tests._model_utils import decode_all, left_padded_batch
cfg = models.ModelConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, attention_bias=True, dtype="bfloat16")
base = models.quantize_base(models.fuse_projections(
    models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1)), "nvfp4")
tokens, mask = (jnp.asarray(a) for a in left_padded_batch(cfg.vocab_size, seed=5))
seen = []
real = da.decode_attention_append
da.decode_attention_append = lambda *a, **k: seen.append(k.get("counters_at")) or real(*a, **k)
outs = []
for on in (0, 1):
  decoder.ATTENTION_COMBINE_IN_KERNEL = on
  outs.append(np.asarray(decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16)[0], np.float32))
rows = np.asarray(mask).astype(bool)
a, b = outs[0][rows], outs[1][rows]
print("counters_at seen:", sorted(set(map(str, seen))), "finite:", np.isfinite(b).all(),
      "rel err:", np.linalg.norm(a - b) / np.linalg.norm(a), "max abs:", np.abs(a - b).max())

"""QeRL's ablation on the embedded default: which base format and whether AQN helps.

Compares, on the tiny synthetic-GSM8K model (assets/tiny-gsm) with the default recipe
(configs/default.py: GRPO, LoRA rank 8 + trainable norms), four variants over several seeds:

* ``bf16_lora``:        bf16 base, LoRA, no noise (the LoRA baseline of QeRL Table 1);
* ``nf4_lora``:         NF4 base (QLoRA, Dettmers et al. 2023), LoRA, no noise;
* ``nvfp4_lora``:       NVFP4 base, LoRA, no noise;
* ``nvfp4_lora_aqn``:   NVFP4 base, LoRA, adaptive quantization noise (QeRL, arXiv:2510.11696).

QeRL's claim (Sec. 4, Fig. 3/5) is that quantization noise raises policy entropy early in
training and so speeds up reward growth; this sweep measures final greedy accuracy, mean
policy entropy over the first quarter of training, and wall time.

  python experiments/ablate.py --config=configs/ablations/qerl.py --workdir=workdirs/ablate
  python experiments/ablate.py --config=configs/ablations/qerl.py --config.seeds=0 \
      --config.base.train.total_steps=20 --workdir=workdirs/ablate_quick     # a quick look (about 3 min)
"""

import os
import sys

import ml_collections

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from configs import default  # noqa: E402


def get_config():
  c = ml_collections.ConfigDict()
  c.base = default.get_config()
  c.base.train.plot = False  # ablate.py draws one plot with every run
  # A shorter budget than the default run so that the whole sweep fits in ~15 min on 2 CPU
  # cores: 80 steps of 4 prompts x G = 8 completions.
  c.base.data.max_prompt_length = 80
  c.base.sampling.max_completion_length = 96
  c.base.rl.num_generations = 8
  c.base.rl.batch_size = 32
  c.base.rl.micro_batch_size = 32
  c.base.optim.learning_rate = 2e-3
  c.base.train.total_steps = 80
  c.base.train.eval_every = 20
  c.base.train.save_every = 80
  c.seeds = (0, 1)
  # (name, ((dotted key, value), ...)) applied on top of `base`, in order.
  c.variants = (
      ("bf16_lora", (("model.quant", "none"), ("aqn.enabled", False))),
      ("nf4_lora", (("model.quant", "nf4"), ("aqn.enabled", False))),
      ("nvfp4_lora", (("model.quant", "nvfp4"), ("aqn.enabled", False))),
      ("nvfp4_lora_aqn", (("model.quant", "nvfp4"), ("aqn.enabled", True))),
  )
  return c

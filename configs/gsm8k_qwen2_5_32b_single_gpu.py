"""QeRL on GSM8K with Qwen2.5-32B-Instruct on ONE GPU (the paper's headline: 32B RL on one H100).

Source (QeRL, arXiv:2510.11696; github.com/NVlabs/QeRL at e8c6e79,
``training/dapo_qwen2.5-32b_nvfp4_single_gpu.sh``): the 7B GSM8K recipe
(``configs/gsm8k_qwen2_5_7b.py``: NVFP4 base, LoRA r32 + norms, AQN 1e-2 -> 5e-4 over 10 stages,
G = 8, lr 1e-5, AdamW 0.9/0.99, weight decay 0.1, warm-up 0.1 + cosine, clip 0.2, prompt 256 /
completion 2048) with the 32B model and the script's per-device batch of 8 completions
(one prompt x G = 8 a step). Memory: the NVFP4 32B base is about 18 GB; activations are
rematerialised per layer and the update runs in micro-batches of 2. A training step peaked at
34.0 GiB on an H200 (experiments/bench_train_step.py, docs/trainer.md). The greedy evaluation
(every eval_every steps) samples eval_batch_size = 64 rows at once, whose bf16 KV cache is
64 x (256 + 2048) slots x 64 layers x 2 x 8 heads x 128 x 2 bytes = 36 GiB on top of the base
(computed, not measured): lower train.eval_batch_size on a card with less room.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gsm8k_qwen2_5_7b  # noqa: E402  (the recipe this one derives from)


def get_config():
  c = gsm8k_qwen2_5_7b.get_config()
  c.model.path = "Qwen/Qwen2.5-32B-Instruct"
  c.rl.batch_size = 8
  c.rl.micro_batch_size = 2
  c.train.total_steps = 1000
  c.train.eval_every = 200
  c.train.eval_batch_size = 64
  return c

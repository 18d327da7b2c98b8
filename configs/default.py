"""The embedded default: GRPO + LoRA + AQN on an NVFP4 tiny model, on a laptop CPU, no download.

The model is the small Qwen2-architecture checkpoint this project trains itself and ships in
``assets/tiny-gsm`` (see assets/tiny-gsm/README.md). While that asset is absent, ``model.path``
is ``random:tiny`` and the trainer builds a randomly initialised tiny model with the synthetic
task's tokenizer in a temporary folder (it runs end to end but learns nothing useful).

Sizes are chosen for 2 CPU cores: 8 prompts x G = 8 completions per step, at most 72 new tokens
(about 5% of the task's worked solutions are longer and get truncated), 120 steps. Measured on
a shared 2-core machine (seed 0, fused projections): held-out greedy accuracy 0.38 -> 0.52
(best 0.55; 100 problems; session 43; 0.39 -> 0.54, best 0.55, on another CPU) in about 95-370 s wall
depending on
the load, 0.7-2.0 s a step (half rollout, half update). docs/trainer.md has the curve.
"""

import os

from qerl_jax import train_config

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
_TINY = os.path.join(_ROOT, "assets", "tiny-gsm")


def get_config():
  c = train_config.base_config()
  c.seed = 0
  c.model.path = _TINY if os.path.isdir(_TINY) else "random:tiny"
  c.model.quant = "nvfp4"
  c.model.remat = False

  c.lora.rank = 8
  c.lora.alpha = 16.0
  c.lora.train_norms = True

  c.aqn.enabled = True
  c.aqn.sigma_start = 1e-2
  c.aqn.sigma_end = 5e-4
  c.aqn.num_stages = 10

  c.data.task = "gsm8k"
  # The synthetic GSM8K-like task the tiny model was pretrained on (qerl_jax/synthetic.py):
  # train and held-out test problems are disjoint by question hash.
  c.data.train = "synthetic:train:4000:1"
  c.data.eval = "synthetic:test:100"
  c.data.max_prompt_length = 64  # synthetic prompts: <= 62 tokens with the chat template
  c.data.eval_size = 100

  c.rl.loss_type = "grpo"
  c.rl.num_generations = 8
  c.rl.batch_size = 64  # 8 prompts x 8 completions
  c.rl.micro_batch_size = 32
  c.rl.num_iterations = 1
  c.rl.epsilon = 0.2
  c.rl.epsilon_high = 0.28
  c.rl.beta = 0.0

  c.sampling.temperature = 1.0
  c.sampling.max_completion_length = 72  # worked solutions: <= 81 tokens, 95% <= 73

  c.optim.learning_rate = 1e-3
  c.optim.warmup_ratio = 0.05
  c.optim.max_grad_norm = 1.0

  c.train.total_steps = 120
  c.train.save_every = 40
  c.train.keep_checkpoints = 3
  c.train.eval_every = 20
  c.train.eval_batch_size = 50
  c.train.log_samples_every = 10
  return c

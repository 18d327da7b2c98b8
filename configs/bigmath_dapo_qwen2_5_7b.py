"""QeRL with DAPO on BigMath: Qwen2.5-7B-Instruct, NVFP4 base, LoRA, AQN (one H100/H200).

Source (QeRL, arXiv:2510.11696; github.com/NVlabs/QeRL at e8c6e79,
``training/dapo_qwen2.5-7b_nvfp4_single_gpu.sh`` with ``DATA_NAME=bigmath`` and
``loss_type=bnpo``):

* DAPO = the ``bnpo`` token-level loss, clip-higher epsilon_high 0.28, no KL (beta 0), one
  iteration per rollout, truncated completions masked;
* max prompt 1024 and max completion 4096 tokens (script's bigmath branch);
* lr 1e-5, AdamW 0.9/0.99, weight decay 0.1, warm-up 0.1 + cosine, clip 0.2 (script);
* AQN 1e-2 -> 5e-4 over 10 stages (paper), LoRA r 32 with trainable norms (paper / ``--ln True``).

The training set is open-r1/Big-Math-RL-Verified-Processed (level 3-5) through the hub, as in
``utils/data.py``; answers are LaTeX, scored with math-verify. Evaluate on MATH-500.
"""

from qerl_jax import data, train_config


def get_config():
  c = train_config.base_config()
  c.seed = 2025
  c.model.path = "Qwen/Qwen2.5-7B-Instruct"
  c.model.quant = "nvfp4"

  c.lora.rank = 32
  c.lora.alpha = 32.0
  c.lora.train_norms = True

  c.aqn.enabled = True
  c.aqn.sigma_start = 1e-2
  c.aqn.sigma_end = 5e-4
  c.aqn.num_stages = 10

  c.data.task = "math"
  c.data.train = "hub:open-r1/Big-Math-RL-Verified-Processed:level_3_4_5:train"
  c.data.eval = "../shared/data/math500/test.jsonl"
  c.data.user_template = data.MATH_USER_TEMPLATE
  c.data.max_prompt_length = 1024

  c.rl.loss_type = "dapo"
  c.rl.num_generations = 8
  c.rl.batch_size = 64
  c.rl.micro_batch_size = 4
  c.rl.num_iterations = 1
  c.rl.epsilon = 0.2
  c.rl.epsilon_high = 0.28
  c.rl.beta = 0.0
  c.rl.mask_truncated_completions = True

  c.sampling.temperature = 1.0
  c.sampling.max_completion_length = 4096

  c.optim.learning_rate = 1e-5
  c.optim.max_grad_norm = 0.2

  c.train.total_steps = 500
  c.train.save_every = 50
  c.train.eval_every = 50
  c.train.eval_batch_size = 100
  return c

"""QeRL on GSM8K with Qwen2.5-32B-Instruct on ONE GPU (the paper's headline: 32B RL on one H100).

Source (QeRL, arXiv:2510.11696; github.com/NVlabs/QeRL at e8c6e79,
``training/dapo_qwen2.5-32b_nvfp4_single_gpu.sh``): NVFP4 base, LoRA, AQN, batch 8 completions
per device, G = 8, lr 1e-5, AdamW 0.9/0.99, weight decay 0.1, warm-up 0.1 + cosine, clip 0.2,
max prompt 256 / completion 2048 for GSM8K, trainable norms. Memory: the NVFP4 32B base is about
18 GB; activations are rematerialised per layer and the update runs in micro-batches of 2.
"""

from qerl_jax import data, train_config


def get_config():
  c = train_config.base_config()
  c.seed = 2025
  c.model.path = "Qwen/Qwen2.5-32B-Instruct"
  c.model.quant = "nvfp4"
  c.model.remat = True

  c.lora.rank = 32
  c.lora.alpha = 32.0
  c.lora.train_norms = True

  c.aqn.enabled = True
  c.aqn.sigma_start = 1e-2
  c.aqn.sigma_end = 5e-4
  c.aqn.num_stages = 10

  c.data.task = "gsm8k"
  c.data.train = "../shared/data/gsm8k/train.jsonl"
  c.data.eval = "../shared/data/gsm8k/test.jsonl"
  c.data.user_template = data.GSM8K_USER_TEMPLATE
  c.data.max_prompt_length = 256

  c.rl.loss_type = "grpo"
  c.rl.num_generations = 8
  c.rl.batch_size = 8  # one prompt x 8 completions per step on one GPU
  c.rl.micro_batch_size = 2
  c.rl.num_iterations = 1
  c.rl.epsilon_high = 0.2
  c.rl.beta = 0.04

  c.sampling.temperature = 1.0
  c.sampling.max_completion_length = 2048

  c.optim.learning_rate = 1e-5
  c.optim.max_grad_norm = 0.2

  c.train.total_steps = 1000
  c.train.save_every = 50
  c.train.eval_every = 200
  c.train.eval_batch_size = 64
  return c

"""QeRL on GSM8K: Qwen2.5-7B-Instruct, NVFP4 base, LoRA, AQN, GRPO (one H100/H200).

Source of each value (QeRL, Huang et al. 2025, arXiv:2510.11696, and its released scripts in
github.com/NVlabs/QeRL at e8c6e79: ``training/dapo_qwen2.5-7b_nvfp4_single_gpu.sh`` and
``utils/configs.py``):

* GRPO with G = 8 completions per prompt, learning rate 1e-5 (paper, Sec. 5 and README's
  "about 1e-5 to 3e-5" for quantized models); LoRA rank 32 (paper's GSM8K runs; the released
  script uses r = alpha = 16), trainable attention/MLP input RMSNorms (script: ``--ln True``);
* AQN sigma 1e-2 -> 5e-4 over 10 stages (paper; the released script ends at 1e-4);
* AdamW betas 0.9/0.99, weight decay 0.1, warm-up ratio 0.1 then cosine, gradient-norm clip 0.2
  (script);
* max prompt 256 and max completion 2048 tokens for GSM8K (script), temperature 1.0 and top-p 1.0
  (TRL defaults, which the script keeps);
* beta = 0.04 KL for the GRPO variant (script's `rl_mode=grpo` branch), num_iterations 1,
  mask_truncated_completions True, seed 2025 (script's --random-state).

Not QeRL's: the prompt and the reward. The released code's GSM8K prompt is the bare question (its system prompt
is commented out) and its reward is 2.0 when the ``<answer>`` text (or the whole completion) equals the gold
string exactly, plus 0.2 for ``<think>...</think><answer>...</answer>``; with that prompt the model rarely
writes those tags. This recipe asks for the answer after "####" (verl's GSM8K instruction) and scores the
number with ``rewards.gsm8k_reward`` (the last "####", ``<answer>`` or box, else the last number; 1.0 or 0), with
no format term. For the released reward's shape, ask for the tags in ``data.system_prompt`` and add
``--config.rl.format_reward_kind=think_answer --config.rl.format_reward_weight=0.1``: group-normalised
advantages do not change when every reward is scaled by the same factor (up to their 1e-4 epsilon), so
1.0 + 0.1 is 2.0 + 0.2.

Run: ``python experiments/train.py --config=configs/gsm8k_qwen2_5_7b.py --workdir=workdirs/gsm8k_7b
--config.model.path=/path/to/Qwen2.5-7B-Instruct``.
"""

from qerl_jax import data, train_config


def get_config():
  c = train_config.base_config()
  c.seed = 2025
  c.model.path = "Qwen/Qwen2.5-7B-Instruct"
  c.model.quant = "nvfp4"
  c.model.remat = True
  c.model.attn_chunk = 512  # attention in 512-query chunks in the update (2304-token sequences)

  c.lora.rank = 32
  c.lora.alpha = 32.0
  c.lora.train_norms = True

  c.aqn.enabled = True
  c.aqn.schedule = "stages"
  c.aqn.sigma_start = 1e-2
  c.aqn.sigma_end = 5e-4
  c.aqn.num_stages = 10

  c.data.task = "gsm8k"
  c.data.train = "../shared/data/gsm8k/train.jsonl"
  c.data.eval = "../shared/data/gsm8k/test.jsonl"
  c.data.user_template = data.GSM8K_USER_TEMPLATE
  c.data.max_prompt_length = 256
  c.data.eval_size = 0

  c.rl.loss_type = "grpo"
  c.rl.num_generations = 8
  c.rl.batch_size = 64  # 8 prompts x 8 completions per step
  c.rl.micro_batch_size = 8
  c.rl.num_iterations = 1
  c.rl.epsilon = 0.2
  c.rl.epsilon_high = 0.2
  c.rl.beta = 0.04
  c.rl.scale_rewards = "group"
  c.rl.mask_truncated_completions = True

  c.sampling.temperature = 1.0
  c.sampling.top_p = 1.0
  c.sampling.max_completion_length = 2048

  c.optim.learning_rate = 1e-5
  c.optim.b1 = 0.9
  c.optim.b2 = 0.99
  c.optim.weight_decay = 0.1
  c.optim.warmup_ratio = 0.1
  c.optim.lr_schedule = "cosine"
  c.optim.max_grad_norm = 0.2

  # One epoch of the 7,473 GSM8K training questions at 8 prompts a step.
  c.train.total_steps = 934
  c.train.save_every = 50
  c.train.keep_checkpoints = 5
  c.train.eval_every = 100
  c.train.eval_batch_size = 128
  c.train.log_samples_every = 10
  return c

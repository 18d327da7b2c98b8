"""QeRL with DAPO on BigMath: Qwen2.5-7B-Instruct, NVFP4 base, LoRA, AQN (one H100/H200).

Source (QeRL, arXiv:2510.11696; github.com/NVlabs/QeRL at e8c6e79,
``training/dapo_qwen2.5-7b_nvfp4_single_gpu.sh`` with ``DATA_NAME=bigmath`` and
``loss_type=bnpo``), on top of the 7B GSM8K recipe (``configs/gsm8k_qwen2_5_7b.py``: NVFP4,
LoRA r32 + norms, AQN 1e-2 -> 5e-4 over 10 stages, lr 1e-5, AdamW 0.9/0.99, wd 0.1, clip 0.2):

* DAPO's token-level loss, clip-higher epsilon_high 0.28, no KL (beta 0), one iteration per rollout,
  truncated completions masked (script's ``bnpo`` branch). The script's TRL ``bnpo`` takes each
  micro-batch's token mean, so its loss depends on the micro-batch size; ``dapo`` here is DAPO's mean over
  all the step's tokens, which ``bnpo`` approximates and which does not change with ``rl.micro_batch_size``
  (``--config.rl.loss_type=bnpo`` gives TRL's);
* max prompt 1024 and max completion 4096 tokens (script's bigmath branch);
* the training set is open-r1/Big-Math-RL-Verified-Processed, level 3-5, from the hub
  (``utils/data.py``; its ``prompt`` and ``solution`` columns are the problem and the answer); LaTeX answers
  are scored with math-verify; evaluation on MATH-500.

Not QeRL's: the prompt and the reward's form. The released code asks, in a system prompt, for ``<think>`` and
``<answer>`` tags, adds 0.2 for them, and has math-verify read the whole completion; this recipe asks for
``\\boxed{}`` and verifies the last box (``rewards.math_reward``), with no format term. Closer to the released
run: a system prompt asking for the tags plus ``--config.rl.format_reward_kind=think_answer
--config.rl.format_reward_weight=0.2`` (its accuracy reward is 1.0); the answer must still be in a
``\\boxed{}`` (keep the MATH user template): one only inside ``<answer>`` tags scores 0 here, unlike the
released reward, which lets math-verify read the whole completion.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gsm8k_qwen2_5_7b  # noqa: E402  (the recipe this one derives from)

from qerl_jax import data  # noqa: E402


def get_config():
  c = gsm8k_qwen2_5_7b.get_config()
  c.data.task = "math"
  c.data.train = "hub:open-r1/Big-Math-RL-Verified-Processed:level_3_4_5:train"
  c.data.eval = "../shared/data/math500/test.jsonl"
  c.data.user_template = data.MATH_USER_TEMPLATE
  c.data.max_prompt_length = 1024

  c.rl.loss_type = "dapo"
  c.rl.micro_batch_size = 4
  c.rl.epsilon_high = 0.28
  c.rl.beta = 0.0
  c.sampling.max_completion_length = 4096

  c.train.total_steps = 500
  c.train.eval_every = 50
  c.train.eval_batch_size = 100
  return c

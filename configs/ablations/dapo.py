"""GRPO against DAPO's pieces on the embedded default (NVFP4 + LoRA + AQN, the QeRL setting).

The same tiny model, data and budget as ``configs/ablations/qerl.py`` (80 steps of 4 prompts x
G = 8 completions, 96 new tokens), with the base in NVFP4 and AQN on. Variants, each adding one of
DAPO's pieces (Yu et al. 2025, arXiv:2503.14476) to the one before:

* ``grpo``:                   GRPO's per-sequence mean loss (DeepSeekMath), clip-higher 0.28 as the default;
* ``dapo_token``:             DAPO's token-level loss (``rl.loss_type="dapo"``, what QeRL's DAPO script runs);
* ``dapo_dynamic``:           + dynamic sampling (sec. 3.2): up to 3 rollouts a step until every group in
                              the update has rewards that are not all equal;
* ``dapo_dynamic_overlong``:  + the soft overlong punishment (eq. 13) over the last 24 of 96 tokens.

Dynamic sampling makes more rollouts a step, so compare its accuracy against its wall time too.

  python experiments/ablate.py --config=configs/ablations/dapo.py --workdir=workdirs/ablate_dapo
"""

import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from configs.ablations import qerl  # noqa: E402  (the shared base and budget)


def get_config():
  c = qerl.get_config()
  c.base.model.quant = "nvfp4"
  c.base.aqn.enabled = True
  c.variants = (
      ("grpo", (("rl.loss_type", "grpo"),)),
      ("dapo_token", (("rl.loss_type", "dapo"),)),
      ("dapo_dynamic", (("rl.loss_type", "dapo"), ("rl.dynamic_sampling", True),
                        ("rl.max_sampling_rounds", 3))),
      ("dapo_dynamic_overlong", (("rl.loss_type", "dapo"), ("rl.dynamic_sampling", True),
                                 ("rl.max_sampling_rounds", 3), ("rl.overlong_buffer_length", 24))),
  )
  return c

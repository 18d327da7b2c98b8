"""The policy objective on the embedded default (NVFP4 + LoRA + AQN, the QeRL setting): GRPO against its successors.

The same tiny model, data and budget as ``configs/ablations/qerl.py`` (80 steps of 4 prompts x G = 8
completions, 96 new tokens), with the base in NVFP4, AQN on, and two updates a rollout
(``rl.num_iterations=2``, TRL's mu). With one update a rollout the importance ratio is exactly 1, and
then GSPO is GRPO and CISPO is DAPO: the second update is where they differ. Variants:

* ``grpo``:        GRPO's per-sequence mean loss with the token ratio clipped to [0.8, 1.28];
* ``dapo``:        DAPO's token-level loss (Yu et al. 2025);
* ``gspo``:        GSPO's sequence-level ratio (Zheng et al. 2025), clipped to [1 - 3e-4, 1 + 4e-4] as in its paper;
* ``cispo``:       CISPO (MiniMax-M1, 2025): the ratio capped at 5 as a weight on every token's gradient;
* ``dapo_top20``:  DAPO's loss on each micro-batch's 20% highest-entropy tokens only (Wang et al. 2025).

  python experiments/ablate.py --config=configs/ablations/objectives.py --workdir=workdirs/ablate_objectives
"""

import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from configs.ablations import dapo  # noqa: E402  (the shared base, budget and QeRL setting)


def get_config():
  c = dapo.get_config()
  c.base.rl.num_iterations = 2
  c.variants = (
      ("grpo", (("rl.loss_type", "grpo"),)),
      ("dapo", (("rl.loss_type", "dapo"),)),
      ("gspo", (("rl.loss_type", "grpo"), ("rl.importance_sampling_level", "sequence"), ("rl.epsilon", 3e-4),
                ("rl.epsilon_high", 4e-4))),
      ("cispo", (("rl.loss_type", "cispo"), ("rl.epsilon_high", 5.0))),
      ("dapo_top20", (("rl.loss_type", "dapo"), ("rl.top_entropy_quantile", 0.2))),
  )
  return c

r"""Train a policy with QeRL (NVFP4 base + LoRA + AQN + GRPO/DAPO) from a config file.

  python experiments/train.py --config=configs/default.py --workdir=workdirs/default
  python experiments/train.py --config=configs/gsm8k_qwen2_5_7b.py --workdir=workdirs/7b \
      --config.model.path=/models/Qwen2.5-7B-Instruct --config.rl.num_generations=16

Every setting lives in the config (``--config.<dotted.key>=value`` overrides one); none is read
from environment variables (the kernels' own switches, docs/kernels.md, pick kernels, not values). Re-running with the ``--workdir`` of an interrupted run
resumes from its last complete checkpoint. The config is validated before any compute: an
unknown key or an impossible setting stops the program with a message naming it.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# transformers warns at import that PyTorch is absent; the project never needs PyTorch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if _ROOT not in sys.path:  # so `configs/*.py` can `import qerl_jax` from a plain checkout
  sys.path.insert(0, _ROOT)

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from qerl_jax import train_config, xla_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file (configs/<name>.py), then --config.<key>=value overrides.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for checkpoints, metrics, samples and plots.")
_XLA = xla_flags.define_launcher_flag()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
  xla_flags.apply_recommended(_XLA.value)  # before the first computation: XLA reads XLA_FLAGS once
  from absl import logging
  from qerl_jax import train_config, trainer
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  try:
    config = _CONFIG.value
    train_config.validate(config)
  except OSError as e:  # ml_collections could not load the config file
    print(train_config.config_load_error(e), file=sys.stderr)
    return 2
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not _WORKDIR.value.strip():
    print("error: --workdir is empty: give the folder for the run's checkpoints, metrics and config", file=sys.stderr)
    return 2
  try:
    summary = trainer.run(config, _WORKDIR.value)
  except trainer.RunSetupError as e:  # the workdir, model, data or checkpoint refused the run before step 1
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"\ninterrupted; the same command resumes from the newest complete checkpoint in "
          f"{os.path.join(os.path.abspath(_WORKDIR.value), 'checkpoints')}", file=sys.stderr)
    return 130
  workdir = os.path.abspath(_WORKDIR.value)
  plots = "plots/, " if bool(config.train.plot) else ""  # train.plot=False draws none
  print(f"\nOutputs in {workdir}: config.json, metrics.jsonl, summary.json, samples.jsonl, {plots}"
        f"checkpoints; TensorBoard events (tensorboard --logdir {workdir}; tensorboard is not "
        f"installed by this project).")
  return 0 if summary.get("status") == "ok" else 1


if __name__ == "__main__":
  app.run(main, flags_parser=train_config.config_flags_parser())

r"""Runs a sweep of config variants one after another and compares them.

  python experiments/ablate.py --config=configs/ablations/qerl.py --workdir=workdirs/ablate

An ablation config (``configs/ablations/*.py``) has three fields:

* ``base``: a full trainer config (e.g. ``configs/default.get_config()``);
* ``variants``: ``((name, ((dotted_key, value), ...)), ...)``, overrides applied to ``base``;
* ``seeds``: the seeds every variant runs with.

Each (variant, seed) trains in ``<workdir>/<name>/seed<k>`` through the trainer's in-process
``qerl_jax.trainer.run(config, workdir)`` (a finished run is resumed, i.e. skipped). At the
end the program prints a table (mean +- std over seeds of the initial and final greedy
held-out accuracy, the mean policy entropy over the first quarter of training, and the wall
time), writes it to ``<workdir>/results.md`` and ``results.json``, and draws one figure with
every run (``<workdir>/ablation.png``: greedy accuracy, reward and entropy against step).

Variant names and seeds must be unique (each run has its own folder). A run that raises does not end the
sweep: the others go on, the failure is listed under the table, and the program exits with status 1;
re-running the same command resumes it (finished runs are skipped).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# transformers warns at import that PyTorch is absent; the project never needs PyTorch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from qerl_jax import train_config, xla_flags  # noqa: E402
import numpy as np  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "An ablation config file (configs/ablations/<name>.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for the runs, the table and the plot.")
_XLA = xla_flags.define_launcher_flag()
flags.mark_flags_as_required(["config", "workdir"])

COLUMNS = (("initial_accuracy", "initial acc"), ("final_accuracy", "final acc"),
           ("mean_entropy_first_quarter", "entropy 1st quarter"), ("wall_time_s", "time (s)"))


def apply_overrides(base, overrides):
  """A deep copy of the ConfigDict ``base`` with ``((dotted_key, value), ...)`` set.

  Raises:
    KeyError: a dotted key the base config does not have (named in the message).
  """
  cfg = copy.deepcopy(base)
  for key, value in overrides:
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
      if p not in node:
        raise KeyError(f"override {key!r}: the base config has no {p!r}")
      node = node[p]
    if leaf not in node:
      raise KeyError(f"override {key!r}: the base config has no {leaf!r}")
    node[leaf] = value
  return cfg


def sweep_problem(names, seeds) -> str | None:
  """What makes a sweep's variant names or seeds unusable, or None.

  Every (variant, seed) trains in its own ``<workdir>/<name>/seed<k>``: a name given twice, a seed given
  twice, or a name that is not one plain folder name would make two runs share a folder (the second
  resumes, i.e. silently reuses, the first's checkpoint) or write outside the sweep's workdir.
  """
  names, seeds = list(names), list(seeds)
  if not names:
    return "variants is empty"
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    return f"variant name(s) {dup} given more than once (each variant trains in <workdir>/<name>/)"
  dup = sorted({k for k in seeds if seeds.count(k) > 1})
  if dup:
    return f"seed(s) {dup} given more than once (each seed trains in <workdir>/<name>/seed<k>)"
  bad = [n for n in names if not isinstance(n, str) or n in ("", ".", "..") or "/" in n or os.sep in n]
  if bad:
    return f"variant name(s) {bad} are not plain folder names"
  if not seeds:
    return "seeds is empty"
  return None


def _fmt(values) -> str:
  vals = [v for v in values if v is not None and math.isfinite(float(v))]
  if not vals:
    return "-"
  if len(vals) == 1:
    return f"{vals[0]:.3f}"
  return f"{np.mean(vals):.3f} ± {np.std(vals):.3f}"


def results_table(results: dict) -> str:
  """A markdown table: one row per variant, mean ± std over seeds of :data:`COLUMNS`."""
  head = "| variant | seeds | " + " | ".join(label for _, label in COLUMNS) + " |"
  lines = [head, "|" + "---|" * (2 + len(COLUMNS))]
  for name, runs in results.items():
    cells = [_fmt([r.get(k) for r in runs]) for k, _ in COLUMNS]
    lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot_all(workdirs: dict, path: str, *, smooth: int = 10) -> None:
  """One figure, three panels (greedy accuracy, reward, entropy vs step), one line per run,
  one colour per variant; reward and entropy as a moving average over ``smooth`` steps."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from qerl_jax import metrics as metrics_lib

  panels = (("eval/accuracy", "greedy held-out accuracy"), ("reward", f"mean reward ({smooth}-step avg)"),
            ("entropy", f"policy entropy, nats/token ({smooth}-step avg)"))
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (name, dirs) in enumerate(workdirs.items()):
    for j, d in enumerate(dirs):
      rows = metrics_lib.read_metrics(d)
      for ax, (key, _) in zip(axes, panels):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
          xs, ys = zip(*pts)
          if key != "eval/accuracy" and len(ys) >= smooth:  # per-step metrics: moving average
            ys = np.convolve(ys, np.ones(smooth) / smooth, mode="valid")
            xs = xs[smooth - 1:]
          ax.plot(xs, ys, color=colours[i % len(colours)], alpha=0.8, marker="." if key == "eval/accuracy" else None,
                  label=name if j == 0 else None)
  for ax, (_, label) in zip(axes, panels):
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_sweep(plan, out: str, run):
  """Runs each ``(name, seed, config)`` of ``plan`` with ``run(config, workdir)`` (the trainer's ``run``) in
  ``<out>/<name>/seed<k>``, one after another.

  A run that raises is reported (traceback on stderr) and skipped; the others go on.

  Returns:
    ``(results, workdirs, failed)``: per variant name, the finished runs' :data:`COLUMNS` values with
    their ``seed`` and ``status`` (a list of dicts), and their workdirs; ``failed`` lists one line per
    run that raised (``"<name> seed <k>: <error>"``).
  """
  import traceback
  results, workdirs, failed = {}, {}, []
  for k, (name, seed, cfg) in enumerate(plan):
    wd = os.path.join(out, name, f"seed{seed}")
    print(f"=== [{k + 1}/{len(plan)}] {name} seed {seed} -> {wd}", flush=True)
    try:
      summary = run(cfg, wd)
    except Exception as e:  # pylint: disable=broad-except  # one failed run must not end the sweep
      traceback.print_exc()
      failed.append(f"{name} seed {seed}: {type(e).__name__}: {e}")
      print(f"=== {name} seed {seed} failed; its workdir {wd} keeps what it wrote; the sweep goes on",
            file=sys.stderr, flush=True)
      continue
    results.setdefault(name, []).append({key: summary.get(key) for key, _ in COLUMNS}
                                        | {"seed": seed, "status": summary.get("status")})
    workdirs.setdefault(name, []).append(wd)
  return results, workdirs, failed


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected positional arguments: {argv[1:]}")
  xla_flags.apply_recommended(_XLA.value)  # before the first computation: XLA reads XLA_FLAGS once
  from absl import logging
  from qerl_jax import train_config, trainer
  logging.set_verbosity(logging.WARNING)
  try:
    ab = _CONFIG.value
    seeds = [int(s) for s in (ab.seeds if isinstance(ab.seeds, (tuple, list)) else [ab.seeds])]  # reads the file
  except OSError as e:  # ml_collections could not load the config file
    print(train_config.config_load_error(e), file=sys.stderr)
    return 2
  out = _WORKDIR.value
  # Build and validate every variant before any compute (and before the workdir is created).
  problem = sweep_problem([name for name, _ in ab.variants], seeds)
  if problem:
    print(f"error: {problem}", file=sys.stderr)
    return 2
  plan = []
  for name, overrides in ab.variants:
    for seed in seeds:
      try:
        cfg = apply_overrides(ab.base, tuple(overrides) + (("seed", seed),))
        train_config.validate(cfg)
      except (KeyError, ValueError) as e:
        print(f"error: variant {name!r} (seed {seed}): {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
      plan.append((name, seed, cfg))
  os.makedirs(out, exist_ok=True)
  results, workdirs, failed = run_sweep(plan, out, trainer.run)
  table = results_table(results)
  if failed:
    table += "\n\nFailed runs (not in the table; re-run the same command to retry them):\n" + "\n".join(
        f"- {line}" for line in failed)
  print(table)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  if workdirs:
    plot_all(workdirs, os.path.join(out, "ablation.png"))
  print(f"wrote {os.path.join(out, 'results.md')}" + (f" and {os.path.join(out, 'ablation.png')}" if workdirs else ""))
  return 1 if failed else 0


if __name__ == "__main__":
  app.run(main, flags_parser=train_config.config_flags_parser(
      "an ablation config has base, variants and seeds; base's keys are listed in "
      "qerl_jax/train_config.py base_config()"))

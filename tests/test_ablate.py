"""experiments/ablate.py helpers: overrides on a trainer config and the comparison table."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


import functools


@functools.lru_cache(maxsize=None)  # ablate.py defines absl flags: import it once
def _load(path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_ablation_config_variants_apply_and_validate():
  ablate = _load(ROOT / "experiments" / "ablate.py")
  ab = _load(ROOT / "configs" / "ablations" / "qerl.py").get_config()
  names = [n for n, _ in ab.variants]
  assert names == ["bf16_lora", "nf4_lora", "nvfp4_lora", "nvfp4_lora_aqn"]
  seen = {}
  for name, overrides in ab.variants:
    cfg = ablate.apply_overrides(ab.base, tuple(overrides) + (("seed", 5),))
    seen[name] = (cfg.model.quant, cfg.aqn.enabled, cfg.seed)
  assert seen == {"bf16_lora": ("none", False, 5), "nf4_lora": ("nf4", False, 5),
                  "nvfp4_lora": ("nvfp4", False, 5), "nvfp4_lora_aqn": ("nvfp4", True, 5)}
  assert ab.base.seed == 0  # the base is copied, never modified
  with pytest.raises(KeyError, match="no 'quantt'"):
    ablate.apply_overrides(ab.base, (("model.quantt", "nf4"),))


def _validated_variants(name):
  """{variant: its trainer config} of configs/ablations/<name>.py, each passed through train_config.validate."""
  from qerl_jax import train_config
  ablate = _load(ROOT / "experiments" / "ablate.py")
  ab = _load(ROOT / "configs" / "ablations" / f"{name}.py").get_config()
  out = {}
  for variant, overrides in ab.variants:
    out[variant] = ablate.apply_overrides(ab.base, tuple(overrides))
    train_config.validate(out[variant], check_paths=False)
  return out


def test_dapo_ablation_adds_one_piece_a_variant_and_validates():
  seen = {name: (c.rl.loss_type, c.rl.dynamic_sampling, c.rl.max_sampling_rounds if c.rl.dynamic_sampling else None,
                 c.rl.overlong_buffer_length, c.model.quant, c.aqn.enabled)
          for name, c in _validated_variants("dapo").items()}
  assert seen == {"grpo": ("grpo", False, None, 0, "nvfp4", True),
                  "dapo_token": ("dapo", False, None, 0, "nvfp4", True),
                  "dapo_dynamic": ("dapo", True, 3, 0, "nvfp4", True),
                  "dapo_dynamic_overlong": ("dapo", True, 3, 24, "nvfp4", True)}


def test_objectives_ablation_variants_validate_and_differ_from_the_base_where_named():
  """configs/ablations/objectives.py: two updates a rollout for every variant (with one the ratio is 1 and GSPO is
  GRPO, CISPO is DAPO), and each variant's objective as its docstring states."""
  seen = {name: (c.rl.loss_type, c.rl.importance_sampling_level, c.rl.epsilon, c.rl.epsilon_high,
                 c.rl.top_entropy_quantile, c.rl.num_iterations, c.model.quant, c.aqn.enabled)
          for name, c in _validated_variants("objectives").items()}
  assert seen == {"grpo": ("grpo", "token", 0.2, 0.28, 1.0, 2, "nvfp4", True),
                  "dapo": ("dapo", "token", 0.2, 0.28, 1.0, 2, "nvfp4", True),
                  "gspo": ("grpo", "sequence", 3e-4, 4e-4, 1.0, 2, "nvfp4", True),
                  "cispo": ("cispo", "token", 0.2, 5.0, 1.0, 2, "nvfp4", True),
                  "dapo_top20": ("dapo", "token", 0.2, 0.28, 0.2, 2, "nvfp4", True)}


def test_results_table_mean_and_std():
  ablate = _load(ROOT / "experiments" / "ablate.py")
  table = ablate.results_table({
      "a": [{"initial_accuracy": 0.2, "final_accuracy": 0.4, "mean_entropy_first_quarter": 0.1, "wall_time_s": 10.0},
            {"initial_accuracy": 0.2, "final_accuracy": 0.6, "mean_entropy_first_quarter": None, "wall_time_s": 30.0}]})
  row = table.splitlines()[2]
  # mean 0.5, population std 0.1 of (0.4, 0.6); a missing entropy is skipped
  assert row == "| a | 2 | 0.200 ± 0.000 | 0.500 ± 0.100 | 0.100 | 20.000 ± 10.000 |"


def _ablate(*args):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
         "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, str(ROOT / "experiments" / "ablate.py"), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300, env=env)


def test_sweep_problem_refuses_runs_that_would_share_a_folder():
  """A name or seed given twice made two runs share <workdir>/<name>/seed<k>: the second resumed (reused) the
  first's checkpoint, whatever its config said."""
  ablate = _load(ROOT / "experiments" / "ablate.py")
  assert ablate.sweep_problem(["a", "b"], [0, 1]) is None
  assert ablate.sweep_problem(["a", "b", "a"], [0]) == (
      "variant name(s) ['a'] given more than once (each variant trains in <workdir>/<name>/)")
  assert ablate.sweep_problem(["a"], [3, 1, 3]) == (
      "seed(s) [3] given more than once (each seed trains in <workdir>/<name>/seed<k>)")
  assert ablate.sweep_problem(["ok", "../up", ""], [0]) == "variant name(s) ['../up', ''] are not plain folder names"
  assert ablate.sweep_problem(["a"], []) == "seeds is empty"
  assert ablate.sweep_problem([], [0]) == "variants is empty"  # wrote an empty results.md and exited 0


def test_run_sweep_goes_on_after_a_run_that_raises(tmp_path, capsys):
  ablate = _load(ROOT / "experiments" / "ablate.py")
  calls = []

  def run(cfg, wd):
    calls.append((cfg, wd))
    if cfg == "bad":
      raise RuntimeError("out of memory")
    return {"final_accuracy": 0.5, "initial_accuracy": 0.25, "status": "ok", "wall_time_s": 2.0}

  plan = [("a", 0, "good"), ("a", 1, "bad"), ("b", 0, "good")]
  results, workdirs, failed = ablate.run_sweep(plan, str(tmp_path), run)
  assert [wd for _, wd in calls] == [str(tmp_path / "a" / "seed0"), str(tmp_path / "a" / "seed1"),
                                     str(tmp_path / "b" / "seed0")]
  assert failed == ["a seed 1: RuntimeError: out of memory"]
  assert workdirs == {"a": [str(tmp_path / "a" / "seed0")], "b": [str(tmp_path / "b" / "seed0")]}
  assert results["a"] == [{"initial_accuracy": 0.25, "final_accuracy": 0.5, "mean_entropy_first_quarter": None,
                           "wall_time_s": 2.0, "seed": 0, "status": "ok"}]
  assert "RuntimeError: out of memory" in capsys.readouterr().err  # the traceback is shown


def test_launcher_config_errors_are_one_line_and_create_nothing(tmp_path):
  """A mistyped key, an impossible variant or a missing file stops ablate.py before any compute with one
  clear error (exit 2), as train.py does, and leaves no workdir behind."""
  wd = tmp_path / "ablate"
  r = _ablate("--config=configs/ablations/qerl.py", f"--workdir={wd}", "--config.base.rl.num_generatons=4")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.startswith("error: unknown config key among ['--config.base.rl.num_generatons=4']: "
                             "'num_generatons' Did you mean \"num_generations\"")
  # qerl.py's base has 32 completions a step: 30 is not a multiple of G = 8, nor does 32 divide it
  r = _ablate("--config=configs/ablations/qerl.py", f"--workdir={wd}", "--config.base.rl.batch_size=30")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.strip().splitlines() == [
      "error: variant 'bf16_lora' (seed 0): impossible config:",
      "  - rl.batch_size=30 is not a multiple of rl.num_generations=8 (batch_size counts completions; "
      "prompts per step = batch_size / num_generations)",
      "  - rl.micro_batch_size=32 must be >= 1 and divide rl.batch_size=30"]
  r = _ablate("--config=configs/ablations/no_such.py", f"--workdir={wd}", "--config.seeds=0")
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.strip().splitlines() == [
      "error: could not load the config file --config:  [Relative path]: configs/ablations/no_such.py "
      "[Errno 2] No such file or directory: 'configs/ablations/no_such.py'"]
  assert not wd.exists()

"""qerl_jax.xla_flags: the launchers' GPU XLA flags never override what the user set."""
from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from qerl_jax import xla_flags

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def test_merge_adds_missing_flags_and_keeps_the_users():
  user = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/d"
  assert xla_flags.merge(user) == ("--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/d "
                                   "--xla_gpu_enable_dynamic_slice_fusion=true "
                                   "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL")
  assert xla_flags.merge("") == ("--xla_gpu_enable_triton_gemm=false "
                                 "--xla_gpu_enable_dynamic_slice_fusion=true "
                                 "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL")
  # a user's own command-buffer setting wins
  assert xla_flags.merge("--xla_gpu_enable_command_buffer=").endswith("--xla_gpu_enable_command_buffer= "
                                                                       "--xla_gpu_enable_triton_gemm=false "
                                                                       "--xla_gpu_enable_dynamic_slice_fusion=true")
  once = xla_flags.merge("")
  assert xla_flags.merge(once) == once  # idempotent
  with pytest.raises(ValueError, match="'xla_foo' must look like --name=value"):
    xla_flags.merge("", ("xla_foo",))


def test_apply_recommended_sets_the_environment_and_warns_after_start(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
  assert xla_flags.apply_recommended(False) == "--xla_dump_to=/tmp/d"
  assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
  jnp.ones(2).block_until_ready()  # a backend is running in this process now
  with pytest.warns(RuntimeWarning, match="take effect only in a new process"):
    merged = xla_flags.apply_recommended(True)
  assert os.environ["XLA_FLAGS"] == merged == xla_flags.merge("--xla_dump_to=/tmp/d")


def test_flags_are_accepted_by_this_jax_in_a_fresh_process():
  """XLA aborts on an unknown flag (or value); this jax must know all three (CPU ignores their effect)."""
  code = ("from qerl_jax import xla_flags; import os; v = xla_flags.apply_recommended(True); "
          "import jax.numpy as jnp; print(float(jnp.arange(4.0).sum()), v)")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                     env={**env, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split()[0] == "6.0" and "--xla_gpu_enable_dynamic_slice_fusion=true" in r.stdout
  assert "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" in r.stdout

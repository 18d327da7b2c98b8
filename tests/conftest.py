"""Shared test fixtures: the ../shared data folder, GPU skipping, the real Qwen2.5 tokenizer."""

import os
import pathlib

# The README's test command runs two pytest-xdist processes; on a GPU each would otherwise take 75% of its memory up
# front (JAX's default) and the second would run out. Set before JAX starts a backend; an explicit setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none visible to JAX)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True)
def _full_precision_float32_matmuls():
  """Float32 matmuls at full precision in every test. On a GPU, JAX's default float32 matmuls are
  TF32 (10-bit mantissas): a float32 forward then moves by about 3e-3 against the float64 and
  PyTorch references the tests hold to 1e-4. On the CPU this is the default anyway."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
  """../shared beside the repository (data and fixtures); skips when absent (a user's fresh clone)."""
  if not SHARED.is_dir():
    pytest.skip(f"{SHARED} not present: these tests read the project's shared data (GSM8K, MATH, third-party "
                "fixtures), which a fresh clone does not have")
  return SHARED


@pytest.fixture(scope="session")
def data_dir(shared_dir) -> pathlib.Path:
  d = shared_dir / "data"
  if not d.is_dir():
    pytest.skip(f"{d} not present")
  return d


@pytest.fixture(scope="session")
def fixtures_dir(shared_dir) -> pathlib.Path:
  d = shared_dir / "fixtures"
  if not d.is_dir():
    pytest.skip(f"{d} not present")
  return d


@pytest.fixture(scope="session")
def qwen_tokenizer(fixtures_dir):
  """The real Qwen2.5-0.5B-Instruct tokenizer from ../shared/fixtures (offline; ~10 s to build
  once per session, so share this fixture rather than loading it again)."""
  transformers = pytest.importorskip("transformers")
  path = fixtures_dir / "qwen2.5-0.5b-instruct"
  if not path.is_dir():
    pytest.skip(f"{path} not present")
  return transformers.AutoTokenizer.from_pretrained(str(path))

"""Small models and data shared by the tests (fixtures, so ``--import-mode=importlib`` works).

Each fixture returns a builder, so a test picks the seed, channels and classes it needs.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile

# One persistent compilation cache for the whole suite: its processes (pytest-xdist's workers,
# the notebooks' kernels, the data-parallel and multi-host children) and its many trainers
# compile the same small programs again and again, and compiling is most of a CPU test's time.
# Set before JAX is imported (JAX reads these variables then); the workers and every child
# inherit them. A folder named from outside is used as it is; otherwise a fresh one per run,
# made by the first process (the xdist controller) and removed when it ends.
_CACHE_VAR = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE = _CACHE_VAR not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ
if _OWN_CACHE:
  os.environ[_CACHE_VAR] = tempfile.mkdtemp(prefix="jaxprune-tests-jax-cache-")
# Every program however quick to compile (JAX's defaults keep only those over a second), and
# no size floor.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# The suite's programs are tiny and run a few steps each, so compiling is most of their time:
# LLVM's optimisation of the compiled CPU code costs more than it saves (a PruneTrain command
# test: 35 s -> 26 s), and XLA:CPU's older elemental emitters compile fusions faster than its
# MLIR fusion emitters (tests/clicktrain/test_aligned_training.py with tests/test_methods.py:
# 126 s -> 70 s). Tests compare functions computed under the same flags, or against NumPy
# within tolerances; no test times anything it asserts. Children get them too (_cpu_env).
_FAST_COMPILE = "--xla_backend_optimization_level=0"
# An XLA build that no longer knows a flag aborts at start-up: this one is kept only where a
# child process started with it runs (checked once, by the first process; the workers and
# children inherit the result in XLA_FLAGS).
_FASTER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
  probe = "import jax.numpy as jnp; jnp.ones(2).sum().block_until_ready()"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flag)
  done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120)
  return done.returncode == 0


if "PYTEST_XDIST_WORKER" not in os.environ:
  _flags = os.environ.get("XLA_FLAGS", "").split()
  if _FAST_COMPILE not in _flags:
    _flags.append(_FAST_COMPILE)
  if _FASTER_EMITTERS not in _flags and _xla_accepts(_FASTER_EMITTERS):
    _flags.append(_FASTER_EMITTERS)
  os.environ["XLA_FLAGS"] = " ".join(_flags)
# The compile-speed flags of this run (a child's XLA_FLAGS start from these).
_COMPILE_FLAGS = " ".join(
  flag for flag in (_FAST_COMPILE, _FASTER_EMITTERS) if flag in os.environ["XLA_FLAGS"].split()
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from jaxprune import clicktrain, data, models  # noqa: E402


def pytest_unconfigure(config):
  if _OWN_CACHE:
    shutil.rmtree(os.environ[_CACHE_VAR], ignore_errors=True)


def pytest_runtest_setup(item):
  # `gpu` tests run the compiled kernels; elsewhere they skip before doing any work.
  if item.get_closest_marker("gpu") and jax.default_backend() != "gpu":
    pytest.skip("needs a CUDA device (jax.default_backend() != 'gpu')")


class TinyCNN(nnx.Module):
  """Stem conv, a 3x3 conv with BatchNorm, a 1x1 conv, a linear head (8 channels).

  The stem has ``in_channels`` inputs (SDGP and ClickTrain leave a 1- or 3-channel stem dense);
  the 3x3 conv gets ClickTrain's patterns and kernel pruning, the 1x1 conv kernel pruning only;
  both get SDGP (8 input channels, 8 outputs: a multiple of m = 4).

  ``dtype`` is the compute dtype of the convs and the head (``None``: float32), as in the
  library's models: parameters stay float32, BatchNorm normalises in float32 (its float32
  statistics promote the input) and the logits are float32.
  """

  def __init__(self, *, in_channels: int, num_classes: int, rngs: nnx.Rngs, dtype=None):
    self.stem = nnx.Conv(in_channels, 8, (3, 3), use_bias=False, dtype=dtype, rngs=rngs)
    self.conv1 = nnx.Conv(8, 8, (3, 3), use_bias=False, dtype=dtype, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, (1, 1), use_bias=False, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(8, num_classes, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    x = nnx.relu(self.bn(self.conv1(x)))
    x = nnx.relu(self.conv2(x))
    return self.head(x.mean((1, 2))).astype(jnp.float32)  # a no-op in float32


@pytest.fixture
def tiny_cnn():
  """``build(seed=0, in_channels=1, num_classes=4, dtype=None) -> TinyCNN``."""

  def build(seed: int = 0, in_channels: int = 1, num_classes: int = 4, dtype=None) -> TinyCNN:
    return TinyCNN(
      in_channels=in_channels, num_classes=num_classes, rngs=nnx.Rngs(seed), dtype=dtype
    )

  return build


@pytest.fixture
def tiny_resnet():
  """``build(seed=0, in_channels=1, num_classes=4, dtype=None) -> models.ResNet``: PruneTrain's
  ResNet-8 (one basic block per stage, 1x1 projections) at half width, stages 8/16/32, computing
  in ``dtype`` (``None``: float32).

  Built from a ``jaxprune.models`` spec, so PruneTrain can reconfigure and rebuild it.
  """

  def build(seed: int = 0, in_channels: int = 1, num_classes: int = 4, dtype=None) -> models.ResNet:
    spec = dataclasses.replace(
      models.prunetrain_resnet_spec(8).scaled(0.5), in_channels=in_channels
    )
    return models.ResNet(spec, num_classes=num_classes, rngs=nnx.Rngs(seed), dtype=dtype)

  return build


def _scale_stream_channel(model: models.ResNet, c, factor: float) -> None:
  """Scales stage-0 stream channel(s) ``c`` (an index or a slice) of a ResNet with one block in
  its first two stages where it is written (stem, the block's conv2) and read (the block's
  conv1, the stage-1 projection and first conv)."""
  for param, index in [
    (model.stem.conv.kernel, (..., c)),
    (model.stages[0][0].conv2.conv.kernel, (..., c)),
    (model.stages[0][0].conv1.conv.kernel, (slice(None), slice(None), c)),
    (model.stages[1][0].shortcut.conv.kernel, (slice(None), slice(None), c)),
    (model.stages[1][0].conv1.conv.kernel, (slice(None), slice(None), c)),
  ]:
    array = np.array(param[...])
    array[index] *= factor
    param[...] = array


@pytest.fixture
def scale_stream_channel():
  """``scale(model, c, factor)``: a stage-0 stream channel of a small ResNet (``tiny_resnet``,
  PruneTrain's ResNet-8) scaled wherever it is written and read; factor 0 makes it dead (what
  PruneTrain's reconfiguration removes), a small factor weak."""
  return _scale_stream_channel


def digits_like(n: int, *, num_classes: int = 4, size: int = 8, seed: int = 0) -> data.Dataset:
  """``n`` grey ``size`` x ``size`` images of ``num_classes`` (at most 4) textures plus noise.

  Like scikit-learn's 8x8 digits, small and learnable in a few epochs, but made in memory:
  horizontal stripes, vertical stripes, a checkerboard, a flat grey. A 3x3 conv tells them
  apart and they survive global average pooling. ``seed`` draws the labels and the noise.
  """
  if not 1 <= num_classes <= 4:
    raise ValueError(f"num_classes must be in [1, 4], got {num_classes}")
  rows, cols = np.indices((size, size))
  templates = np.stack([rows % 2, cols % 2, (rows + cols) % 2, np.full((size, size), 0.5)])
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, num_classes, n)
  images = 64 + 128 * templates[labels, :, :, None] + rng.normal(0, 32, (n, size, size, 1))
  return data.Dataset.from_arrays(
    np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.int32), num_classes=num_classes
  )


@pytest.fixture
def digits_loader():
  """``build(n=96, batch_size=16, seed=0, shuffle=True, num_classes=4) -> data.Loader`` over
  :func:`digits_like` data (test sets: another ``seed``, ``shuffle=False``)."""

  def build(
    n: int = 96, batch_size: int = 16, seed: int = 0, shuffle: bool = True, num_classes: int = 4
  ) -> data.Loader:
    dataset = digits_like(n, num_classes=num_classes, seed=seed)
    return data.Loader(dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=shuffle)

  return build


def _optax_train_step(loss_fn, tx):
  """The jitted training step of ``tx`` on ``loss_fn(params, x, y)`` (the loss goes to ``tx`` as
  ``value``): ``step(params, state, x, y) -> (params, state)``."""

  @jax.jit
  def step(p, st, x, y):
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)
    u, st = tx.update(g, st, p, value=loss)
    return optax.apply_updates(p, u), st

  return step


@pytest.fixture
def optax_train_step():
  """Builder of the jitted training step of an Optax transform on a plain loss:
  ``optax_train_step(loss_fn, tx)``."""
  return _optax_train_step


@pytest.fixture
def one_shot_clicktrain():
  """Builder of the ClickTrain transform the masking tests share: one-shot masks from the first
  batch, hard prune from epoch 1 on (2 steps per epoch: the state says "pruned" and the weights
  are masked from the end of epoch 1 on)."""

  def build():
    return clicktrain.clicktrain(
      optax.sgd(0.05, momentum=0.9),
      steps_per_epoch=2,
      hard_prune_epoch=1,
      mode="one_shot",
      one_shot_epoch=0,
      kernel_prune_ratio=0.5,
    )

  return build


def _cpu_env(extra: dict[str, str] | None = None) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", **(extra or {}))
  env.pop("XLA_FLAGS", None)  # a device count forced from outside would override the script's
  env["XLA_FLAGS"] = _COMPILE_FLAGS
  return env


@pytest.fixture(scope="session")
def cpu_env():
  """``cpu_env(extra=None)``: this environment for a CPU-only child process (no forced
  ``XLA_FLAGS`` device count), plus ``extra``."""
  return _cpu_env


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
  """``once(name, produce)``: ``produce()``'s result (JSON), computed by the first pytest-xdist
  worker that asks and read from a file by the others. A module-scoped fixture is otherwise
  paid by every worker that runs one of its module's tests (a data-parallel child process: half
  a minute each). The workers' temporary folders share a parent; a lock orders them."""
  root = tmp_path_factory.getbasetemp()
  if "PYTEST_XDIST_WORKER" in os.environ:  # gw0, gw1, ...: their folders share a parent
    root = root.parent

  def once(name: str, produce):
    path = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      try:
        if path.exists():
          return json.loads(path.read_text())
        value = produce()
        path.write_text(json.dumps(value))
        return value
      finally:
        fcntl.flock(lock, fcntl.LOCK_UN)

  return once


@pytest.fixture
def run_python():
  """Runs Python source in a fresh CPU-only interpreter: device counts (``jax_num_cpu_devices``)
  and ``jax.distributed`` must be set up before JAX starts, which this test process did long ago.

  ``run(source, env=None, timeout=120)`` returns the ``subprocess.CompletedProcess`` (text).
  """

  def run(source: str, *, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
      [sys.executable, "-c", source],
      check=False,
      capture_output=True,
      text=True,
      env=_cpu_env(env),
      timeout=timeout,
    )

  return run

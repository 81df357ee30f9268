"""Shared pieces of the jaxprune.train tests (a fixture, so ``--import-mode=importlib`` works)."""

from __future__ import annotations

import dataclasses
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprune.train as jt


@dataclasses.dataclass(frozen=True)
class TinySpec:
  widths: tuple[int, ...] = (4,)


class TinyCNN(nnx.Module):
  """Conv-BN-ReLU, dropout, linear head: has batch stats and an RNG stream."""

  def __init__(
    self, spec: TinySpec = TinySpec(), *, num_classes: int = 3, rngs: nnx.Rngs, dropout: float = 0.2
  ):
    self.spec, self.num_classes = spec, num_classes
    (width,) = spec.widths
    self.c1 = nnx.Conv(1, width, (3, 3), use_bias=False, rngs=rngs)
    self.b1 = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.b1(self.c1(x)))
    return self.head(self.drop(x.mean((1, 2))))


class ArrayLoader:
  """Deterministic loader: order depends only on (seed, epoch)."""

  def __init__(self, images, labels, batch_size, *, shuffle=True, seed=0, drop_last=True):
    self.images, self.labels = images, labels
    self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
    self.epoch = 0

  def set_epoch(self, epoch):
    self.epoch = epoch

  def __len__(self):
    n = len(self.images)
    return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

  def __iter__(self):
    n = len(self.images)
    order = (
      np.random.default_rng((self.seed, self.epoch)).permutation(n)
      if self.shuffle
      else np.arange(n)
    )
    for i in range(len(self)):
      idx = order[i * self.batch_size : (i + 1) * self.batch_size]
      yield self.images[idx], self.labels[idx]


def _data(n=48, size=6, num_classes=3, seed=0):
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, num_classes, n).astype(np.int32)
  images = rng.normal(size=(n, size, size, 1)).astype(np.float32)
  images[:, :2, :2, 0] += labels[:, None, None] * 1.5  # learnable signal
  return images, labels


def _model(seed=0, spec=TinySpec(), dropout=0.2):
  return TinyCNN(spec, rngs=nnx.Rngs(seed, dropout=seed + 1), dropout=dropout)


# One optimizer, smoothing and batch shape (8 x 6x6x1) shared by most tests, so they reuse
# the compiled steps (jaxprune.train.step_functions caches them) instead of recompiling.
_TX = jt.sgd(jt.step_schedule(0.1, steps_per_epoch=6, milestones=[2]), 0.9, weight_decay=1e-3)
_SMOOTHING = 0.1


def _trainer(model=None, **kwargs):
  return jt.Trainer(
    model if model is not None else _model(), _TX, label_smoothing=_SMOOTHING, **kwargs
  )


_TIMING_KEYS = {
  "images_per_s",
  "step_images_per_s",
  "data_wait_s",
  "epoch_time_s",
  "cpu_time_s",
  "eval_time_s",
  "wall_time_s",
}


def _assert_trees_equal(a, b):
  def plain(x):
    x = jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    return np.asarray(x)

  jax.tree.map(lambda x, y: np.testing.assert_array_equal(plain(x), plain(y)), a, b)


def _strip_timing(history):
  return [{k: v for k, v in r.items() if k not in _TIMING_KEYS} for r in history]


class _BusyLoader(ArrayLoader):
  """Spends ``busy_s`` of CPU (not sleep) producing every batch."""

  busy_s = 0.05

  def __iter__(self):
    for batch in super().__iter__():
      start = time.process_time()
      while time.process_time() - start < self.busy_s:
        pass
      yield batch


def _lr_states(opt_state):
  is_lr = lambda n: isinstance(n, jt.ScaleByLrState)  # noqa: E731
  return [n for n in jax.tree.leaves(opt_state, is_leaf=is_lr) if is_lr(n)]


class _BatchAndWidthHook(jt.Callback):
  """After epoch 1: double the batch (linear LR scaling) and replace the model by a
  narrower one (PruneTrain-like reconfiguration, new shapes)."""

  def __init__(self):
    self.calls = []

  def on_epoch_end(self, trainer, epoch):
    self.calls.append(epoch)
    if epoch == 1:
      trainer.set_batch_size(16)
      new_model = _model(seed=5, spec=TinySpec((3,)))
      new_state = trainer.tx.init(nnx.as_pure(nnx.state(new_model, nnx.Param)))
      # Keep the LR state (schedule position, scale), as a real reconfiguration that slices
      # the old optimizer state does.
      (old_lr,) = _lr_states(trainer.opt_state)
      new_state = jax.tree.map(
        lambda n: old_lr if isinstance(n, jt.ScaleByLrState) else n,
        new_state,
        is_leaf=lambda n: isinstance(n, jt.ScaleByLrState),
      )
      trainer.replace(new_model, new_state)
    return {"hook_epoch": epoch}

@pytest.fixture
def kit():
  """The trainer tests' tiny CNN, array loader, data, shared optimizer and trainer builder,
  comparison helpers and hooks (one optimizer, smoothing and batch shape, so the tests reuse
  the compiled steps)."""
  return types.SimpleNamespace(
    TinySpec=TinySpec,
    ArrayLoader=ArrayLoader,
    data=_data,
    model=_model,
    TX=_TX,
    SMOOTHING=_SMOOTHING,
    trainer=_trainer,
    assert_trees_equal=_assert_trees_equal,
    strip_timing=_strip_timing,
    lr_states=_lr_states,
    BatchAndWidthHook=_BatchAndWidthHook,
    BusyLoader=_BusyLoader,
  )

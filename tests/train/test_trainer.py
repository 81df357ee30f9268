"""Tests of jaxprune.train: step, loss, optimizer, schedules, eval, checkpoints, hooks."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxprune.train as jt
from jaxprune.train._spec_json import decode_spec, encode_spec

# ----------------------------------------------------------------------------- fixtures


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


# ----------------------------------------------------------------------------- loss


def _np_smoothed_ce(logits, targets, eps):
  logits = np.asarray(logits, np.float64)
  c = logits.shape[-1]
  t = targets * (1 - eps) + eps / c
  z = logits - logits.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return -(t * logp).sum(-1)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_cross_entropy_int_labels_matches_numpy(eps):
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(7, 5)).astype(np.float32) * 3
  labels = rng.integers(0, 5, 7)
  want = _np_smoothed_ce(logits, np.eye(5)[labels], eps)
  got = jt.cross_entropy_per_example(jnp.asarray(logits), jnp.asarray(labels), eps)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jt.cross_entropy(logits, labels, eps), want.mean(), rtol=1e-5)


def test_cross_entropy_soft_labels_matches_numpy():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(6, 4)).astype(np.float32)
  soft = rng.dirichlet(np.ones(4), size=6).astype(np.float32)  # mixup-like targets
  want = _np_smoothed_ce(logits, soft, 0.1)
  got = jt.cross_entropy_per_example(jnp.asarray(logits), jnp.asarray(soft), 0.1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # accuracy on soft labels compares with the argmax class
  acc = jt.accuracy(jnp.asarray(logits), jnp.asarray(soft))
  assert float(acc) == pytest.approx(np.mean(logits.argmax(-1) == soft.argmax(-1)))


def test_cross_entropy_bad_inputs():
  with pytest.raises(ValueError, match="label_smoothing"):
    jt.cross_entropy(jnp.zeros((2, 3)), jnp.zeros(2, jnp.int32), 1.0)
  with pytest.raises(ValueError, match="labels"):
    jt.cross_entropy(jnp.zeros((2, 3)), jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="logits"):
    jt.cross_entropy(jnp.zeros((2, 3, 1)), jnp.zeros(2, jnp.int32))


# ----------------------------------------------------------------------------- schedules


def test_step_schedule_hand_computed():
  sched = jt.step_schedule(0.1, steps_per_epoch=5, milestones=[2, 4], factor=0.1)
  got = [float(sched(s)) for s in (0, 9, 10, 19, 20, 100)]
  np.testing.assert_allclose(got, [0.1, 0.1, 0.01, 0.01, 0.001, 0.001], rtol=1e-6)
  # float steps (dynamic batch) still cross the milestone at the same epoch boundary
  assert float(sched(9.5)) == pytest.approx(0.1)
  assert float(sched(10.0)) == pytest.approx(0.01)


def test_triangular_schedule_hand_computed():
  sched = jt.triangular_schedule(0.5, steps_per_epoch=4, peak_epoch=2, total_epochs=6)
  # up: 0 -> 0.5 over 8 steps; down: 0.5 -> 0 over 16 steps
  steps = [0, 2, 8, 12, 24, 30]
  want = [0.0, 0.125, 0.5, 0.375, 0.0, 0.0]
  np.testing.assert_allclose([float(sched(s)) for s in steps], want, atol=1e-7)
  # identical to the ffcv formula np.interp(step, [0, peak, total], [0, 1, 0]) * lr
  for s in range(0, 26):
    assert float(sched(s)) == pytest.approx(0.5 * np.interp(s, [0, 8, 24], [0, 1, 0]), abs=1e-7)


def test_warmup_hand_computed():
  base = jt.step_schedule(1.0, steps_per_epoch=10, milestones=[1])
  sched = jt.with_warmup(base, warmup_steps=4, start_factor=0.2)
  want = [0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 0.1]
  got = [float(sched(s)) for s in (0, 1, 2, 3, 4, 9, 10)]
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
  "call, arg",
  [
    (lambda: jt.step_schedule(0.1, 0, [1]), "steps_per_epoch"),
    (lambda: jt.step_schedule(0.1, 10, [5, 3]), "milestones"),
    (lambda: jt.step_schedule(0.1, 10, [-1]), "milestones"),
    (lambda: jt.step_schedule(0.1, 10, [1], factor=0.0), "factor"),
    (lambda: jt.triangular_schedule(0.1, 10, peak_epoch=5, total_epochs=3), "peak_epoch"),
    (lambda: jt.triangular_schedule(0.1, 10, peak_epoch=0, total_epochs=0), "total_epochs"),
    (lambda: jt.with_warmup(0.1, -1), "warmup_steps"),
    (lambda: jt.with_warmup(0.1, 3, start_factor=2.0), "start_factor"),
    (lambda: jt.sgd(0.1, momentum=1.0), "momentum"),
    (lambda: jt.sgd(0.1, weight_decay=-1.0), "weight_decay"),
    (lambda: jt.sgd(0.1, momentum=0.0, nesterov=True), "nesterov"),
  ],
)
def test_bad_schedule_and_optimizer_args(call, arg):
  with pytest.raises(ValueError, match=arg):
    call()


# ----------------------------------------------------------------------------- optimizer


def _torch_sgd_reference(params, grads_seq, lr, momentum, wd, nesterov, decay):
  """torch.optim.SGD (dampening 0) written as a plain loop over numpy arrays."""
  params = {k: np.array(v, np.float64) for k, v in params.items()}
  buf = {k: None for k in params}
  for grads in grads_seq:
    for k in params:
      d = np.asarray(grads[k], np.float64) + (wd * params[k] if decay[k] else 0.0)
      buf[k] = d.copy() if buf[k] is None else momentum * buf[k] + d
      step = d + momentum * buf[k] if nesterov else buf[k]
      params[k] = params[k] - lr * step
  return params


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("only_kernels", [False, True])
def test_sgd_weight_decay_matches_torch_loop(nesterov, only_kernels):
  rng = np.random.default_rng(3)
  params = {
    "kernel": rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
    "bias": rng.normal(size=(4,)).astype(np.float32),
  }
  grads_seq = [
    {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(4)
  ]
  tx = jt.sgd(
    0.05,
    0.9,
    nesterov=nesterov,
    weight_decay=0.01,
    decay_mask=jt.kernels_only if only_kernels else None,
  )
  p = jax.tree.map(jnp.asarray, params)
  state = tx.init(p)
  for g in grads_seq:
    updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, p)
    p = optax.apply_updates(p, updates)
  decay = {"kernel": True, "bias": not only_kernels}
  want = _torch_sgd_reference(params, grads_seq, 0.05, 0.9, 0.01, nesterov, decay)
  for k in params:
    np.testing.assert_allclose(p[k], want[k], rtol=1e-5, atol=1e-6)


class _Wrapped(NamedTuple):
  inner: Any


def _hard_mask_wrapper(inner, mask_value=0.0):
  """A ClickTrain-like wrapper that controls the final update: p <- mask * (p + u)."""

  def init(params):
    return _Wrapped(inner.init(params))

  def update(updates, state, params=None, **extra):
    u, inner_state = inner.update(updates, state.inner, params, **extra)
    out = jax.tree.map(lambda p, d: mask_value * 0 + (p + d) * (p != 0) - p, params, u)
    return out, _Wrapped(inner_state)

  return optax.GradientTransformationExtraArgs(init, update)


def test_lr_scale_reaches_inner_optimizer_inside_wrapper():
  params = {"w": jnp.array([1.0, 0.0, 2.0])}
  grads = {"w": jnp.array([1.0, 1.0, 1.0])}
  tx = _hard_mask_wrapper(jt.sgd(0.1, momentum=0.0))
  state = jt.set_lr_scale(tx.init(params), 3.0)
  updates, state = tx.update(grads, state, params)
  new = optax.apply_updates(params, updates)
  # scaled inner update (-0.3) on kept weights; the pruned weight stays exactly 0
  np.testing.assert_allclose(new["w"], [0.7, 0.0, 1.7], rtol=1e-6)
  assert jt.get_lr_scale(state) == pytest.approx(3.0)
  assert jt.get_lr(state) == pytest.approx(0.3)


def test_set_lr_scale_without_scale_by_lr_is_an_error():
  state = optax.sgd(0.1).init({"w": jnp.zeros(2)})
  with pytest.raises(ValueError, match="scale_by_lr"):
    jt.set_lr_scale(state, 2.0)
  with pytest.raises(ValueError, match="lr_scale"):
    jt.set_lr_scale(jt.sgd(0.1).init({"w": jnp.zeros(2)}), 0.0)


# ----------------------------------------------------------------------------- train step


class _RecordState(NamedTuple):
  value: jax.Array
  calls: jax.Array


def _record_value():
  """GradientTransformationExtraArgs that stores the `value` it receives."""

  def init(params):
    del params
    return _RecordState(jnp.zeros([], jnp.float32), jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, *, value=None, **extra):
    del params, extra
    return updates, _RecordState(jnp.asarray(value, jnp.float32), state.calls + 1)

  return optax.GradientTransformationExtraArgs(init, update)


def test_train_step_passes_loss_as_value_to_extra_args_transform():
  images, labels = _data(8)
  model = _model(dropout=0.0)
  reference = nnx.clone(model)
  reference.train()
  want = jt.cross_entropy(reference(jnp.asarray(images)), jnp.asarray(labels), 0.1)
  trainer = jt.Trainer(model, optax.chain(_record_value(), optax.sgd(0.1)), label_smoothing=0.1)
  m = jt.Metrics.zeros()
  _, _, opt_state, m = trainer.steps.train(
    trainer.params, trainer.rest, trainer.opt_state, m, images, labels
  )
  recorded = opt_state[0]
  assert int(recorded.calls) == 1
  np.testing.assert_allclose(float(recorded.value), float(want), rtol=1e-5)
  np.testing.assert_allclose(m.summary()["loss"], float(want), rtol=1e-5)


def test_train_step_matches_nnx_optimizer():
  """One step of the split/merge jitted step == nnx.Optimizer.update (the reference API)."""
  images, labels = _data(8)
  model_a, model_b = _model(dropout=0.0), _model(dropout=0.0)
  tx = jt.sgd(0.1, 0.9, weight_decay=1e-3)
  trainer = jt.Trainer(model_a, tx)
  opt = nnx.Optimizer(model_b, tx, wrt=nnx.Param)

  @nnx.jit
  def reference_step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jt.cross_entropy(m(x), y))(model)
    opt.update(model, grads, value=loss)

  model_b.train()
  for _ in range(2):
    reference_step(model_b, opt, jnp.asarray(images), jnp.asarray(labels))
    trainer.params, trainer.rest, trainer.opt_state, _ = trainer.steps.train(
      trainer.params, trainer.rest, trainer.opt_state, jt.Metrics.zeros(), images, labels
    )
    trainer._model_synced = False
  got = nnx.state(trainer.model, nnx.Param)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    nnx.as_pure(got),
    nnx.as_pure(nnx.state(model_b, nnx.Param)),
  )
  # batch statistics were updated the same way
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    nnx.as_pure(nnx.state(trainer.model, nnx.BatchStat)),
    nnx.as_pure(nnx.state(model_b, nnx.BatchStat)),
  )


def test_eval_flip_tta_and_padding_match_eager_model():
  images, labels = _data(10)
  model = _model()
  trainer = _trainer(model, flip_tta=True)
  loader = ArrayLoader(images, labels, 4, shuffle=False, drop_last=False)  # 4 + 4 + 2
  got = trainer.evaluate(loader)
  ref = nnx.clone(model)
  ref.eval()
  x = jnp.asarray(images)
  logits = 0.5 * (ref(x) + ref(x[:, :, ::-1, :]))
  want_loss = float(jt.cross_entropy(logits, jnp.asarray(labels), _SMOOTHING))
  want_acc = float(jt.accuracy(logits, jnp.asarray(labels)))
  assert got["test_loss"] == pytest.approx(want_loss, rel=1e-5)
  assert got["test_acc"] == pytest.approx(want_acc)
  # flip TTA changes the logits of this (not flip-invariant) model
  plain = float(jt.cross_entropy(ref(x), jnp.asarray(labels), _SMOOTHING))
  assert abs(plain - want_loss) > 1e-6


def test_step_memory_grows_with_batch():
  trainer = _trainer()
  small = trainer.step_memory(8, (6, 6, 1))
  large = trainer.step_memory(32, (6, 6, 1))
  assert large["argument"] > small["argument"]
  assert large["total"] > small["total"] > 0
  with pytest.raises(ValueError, match="batch_size"):
    trainer.step_memory(0, (6, 6, 1))
  assert trainer.step_memory(32, (6, 6, 1))["total"] > trainer.step_memory(24, (6, 6, 1))["total"]


# ----------------------------------------------------------------------------- fit / hooks


def test_fit_learns_and_writes_json_lines(tmp_path):
  images, labels = _data(48)
  log = tmp_path / "log.jsonl"
  trainer = jt.fit(
    _model(),
    _TX,
    ArrayLoader(images, labels, 8),
    ArrayLoader(images[:16], labels[:16], 8, shuffle=False),
    epochs=4,
    log_path=log,
    label_smoothing=_SMOOTHING,
    metrics={"double_epoch": lambda t: 2 * t.epoch},
  )
  records = [json.loads(line) for line in log.read_text().splitlines()]
  assert [r["epoch"] for r in records] == [1, 2, 3, 4]
  assert [r["double_epoch"] for r in records] == [2, 4, 6, 8]
  for key in (
    "train_loss",
    "train_acc",
    "test_loss",
    "test_acc",
    "lr",
    "images_per_s",
    "step_images_per_s",
    "wall_time_s",
    "batch_size",
  ):
    assert key in records[0]
  assert records[-1]["train_loss"] < records[0]["train_loss"]
  assert records[-1]["step"] == 4 * 6
  assert records[0]["lr"] == pytest.approx(0.1)
  assert records[-1]["lr"] == pytest.approx(0.01)  # step schedule: x0.1 from epoch 2
  assert trainer.history == records


def test_nonfinite_step_is_left_out_of_the_epoch_loss_and_counted():
  # One NaN batch of four: the epoch's train loss / accuracy are those of the three finite
  # batches (a plain loop over the model), the NaN step is counted and warned about.
  images, labels = _data(32)
  images[16] = np.nan  # batch 2 of 4 (no shuffle): BatchNorm spreads it to the whole batch
  model = _model(dropout=0.0)
  reference = nnx.clone(model)
  reference.train()  # batch statistics: the loss does not depend on the running averages
  losses, correct = [], 0
  for b in (0, 1, 3):  # lr 0: the params stay the initial ones
    x, y = jnp.asarray(images[8 * b : 8 * b + 8]), jnp.asarray(labels[8 * b : 8 * b + 8])
    logits = reference(x)
    losses.append(float(jt.cross_entropy(logits, y)))
    correct += int(np.sum(np.argmax(np.asarray(logits), -1) == labels[8 * b : 8 * b + 8]))
  trainer = jt.Trainer(model, optax.apply_if_finite(optax.sgd(0.0), 5))
  with pytest.warns(RuntimeWarning, match="epoch 1: 1 of 4 train steps had a non-finite loss"):
    (record,) = trainer.fit(ArrayLoader(images, labels, 8, shuffle=False), epochs=1)
  assert record["nonfinite_steps"] == 1
  np.testing.assert_allclose(record["train_loss"], np.mean(losses), rtol=1e-5)
  assert record["train_acc"] == pytest.approx(correct / 24)


class _BusyLoader(ArrayLoader):
  """Spends ``busy_s`` of CPU (not sleep) producing every batch."""

  busy_s = 0.05

  def __iter__(self):
    for batch in super().__iter__():
      start = time.process_time()
      while time.process_time() - start < self.busy_s:
        pass
      yield batch


def test_epoch_cpu_time_counts_the_process_cpu_seconds():
  images, labels = _data(48)
  loader = _BusyLoader(images, labels, 8)
  trainer = _trainer()
  trainer.train_epoch(loader)  # compile outside the measured epoch
  before = time.process_time()
  record = trainer.train_epoch(loader)
  outer = time.process_time() - before
  # the loader's busy loop is CPU time of the process; sleeping would not be
  assert len(loader) * _BusyLoader.busy_s <= record["cpu_time_s"] <= outer


def test_empty_loader_is_an_error():
  images, labels = _data(8)
  trainer = _trainer()
  with pytest.raises(ValueError, match="no batches"):
    trainer.fit(ArrayLoader(images, labels, 16), epochs=1)  # batch > dataset, drop_last
  with pytest.raises(ValueError, match="epochs"):
    trainer.fit(ArrayLoader(images, labels, 4), epochs=0)


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


def test_hooks_change_batch_size_lr_and_model():
  images, labels = _data(48)
  loader = ArrayLoader(images, labels, 8)
  hook = _BatchAndWidthHook()
  trainer = _trainer(callbacks=[hook])
  history = trainer.fit(loader, epochs=2)
  assert hook.calls == [1, 2]
  assert [r["hook_epoch"] for r in history] == [1, 2]
  assert [r["batch_size"] for r in history] == [8, 16]
  assert [r["steps"] for r in history] == [6, 3]
  assert trainer.lr_scale == pytest.approx(2.0)
  # schedule positions 6, 8, 10 are before the epoch-2 milestone (12): base 0.1 x scale 2
  assert history[1]["lr"] == pytest.approx(0.2)
  assert trainer.model.spec == TinySpec((3,))
  assert trainer.model.c1.kernel.shape == (3, 3, 1, 3)
  # schedule advances by 16/8 = 2 reference steps per step after the batch change
  (lr_state,) = _lr_states(trainer.opt_state)
  assert float(lr_state.step_increment) == pytest.approx(2.0)
  assert float(lr_state.step) == pytest.approx(6 + 3 * 2.0)


def test_replace_rejects_mismatched_optimizer_state():
  trainer = _trainer()
  narrow = _model(spec=TinySpec((3,)))
  with pytest.raises(ValueError, match="opt_state"):
    trainer.replace(narrow, trainer.opt_state)  # state still shaped for width 4
  trainer.replace(narrow, _TX.init(nnx.as_pure(nnx.state(narrow, nnx.Param))))
  assert trainer.params["c1"]["kernel"].shape == (3, 3, 1, 3)


def test_step_hook_runs_every_k_steps():
  images, labels = _data(48)
  seen = []

  class Every3(jt.Callback):
    every_steps = 3

    def on_step(self, trainer, step):
      seen.append(step)
      trainer.lr_scale = 0.5

  trainer = _trainer(callbacks=[Every3()], progress=True)  # also runs the tqdm path
  history = trainer.fit(ArrayLoader(images, labels, 8), epochs=1)
  assert seen == [3, 6]
  assert history[0]["lr"] == pytest.approx(0.05)  # the last steps ran at 0.1 x 0.5


def test_train_epoch_end_hook_runs_after_training_before_evaluation():
  images, labels = _data(48)
  events = []

  class Probe(jt.Callback):
    def on_train_epoch_end(self, trainer, epoch, train_loader):
      events.append(("train_end", epoch, trainer.step, train_loader is loader))
      # What it changes is what the evaluation sees: zero the head, every logit is 0.
      model = trainer.model
      model.head.kernel[...] = 0.0 * model.head.kernel[...]
      model.head.bias[...] = 0.0 * model.head.bias[...]
      trainer.replace(model)

    def on_epoch_end(self, trainer, epoch):
      events.append(("epoch_end", epoch, trainer.step))

  class LoggedTestLoader(ArrayLoader):
    def __iter__(self):
      events.append(("evaluate",))
      return super().__iter__()

  loader = ArrayLoader(images, labels, 8)
  history = _trainer(callbacks=[Probe()]).fit(
    loader, LoggedTestLoader(images, labels, 8, shuffle=False), epochs=1
  )
  assert events == [("train_end", 1, 6, True), ("evaluate",), ("epoch_end", 1, 6)]
  # Zero logits: the (smoothed) cross-entropy of a uniform prediction over 3 classes.
  assert history[0]["test_loss"] == pytest.approx(np.log(3.0), rel=1e-5)


# ----------------------------------------------------------------------------- checkpoints


def _loaders(use_data_package):
  images, labels = _data(48)
  if use_data_package:
    from jaxprune import data

    # The same small images as uint8, through the data package's seeded, resumable loader
    # with augmentation (pad-crop + flip draws depend on (seed, epoch, step)).
    uint8 = np.clip(images * 40 + 128, 0, 255).astype(np.uint8)
    dataset = data.Dataset.from_arrays(uint8, labels)
    return (
      data.Loader(dataset, 8, shuffle=True, seed=3, augment="prunetrain", prefetch=0),
      data.Loader(dataset, 8, shuffle=False, drop_last=False, prefetch=0),
    )
  return (
    ArrayLoader(images, labels, 8, seed=3),
    ArrayLoader(images[:16], labels[:16], 8, shuffle=False),
  )


def _run(tmp_path, epochs, hook=None, use_data_package=False):
  train, test = _loaders(use_data_package)
  model = _model()
  trainer = _trainer(
    model,
    checkpoint_dir=tmp_path / "ckpt",
    log_path=tmp_path / "log.jsonl",
    callbacks=[hook] if hook else [],
  )
  trainer.fit(train, test, epochs=epochs)
  return trainer


@pytest.mark.parametrize("reconfigure, stop", [(False, 2), (True, 1)])
def test_resume_is_exact(tmp_path, reconfigure, stop):
  """4 epochs straight == `stop` epochs, stop, fresh trainer resumes, finishes.

  Without ``reconfigure`` the data come from ``jaxprune.data.Loader`` (shuffle and
  augmentation draws seeded per epoch, position saved via ``state()``). With it a hook
  shrinks the model and asks for a doubled batch after epoch 1, so the resume must rebuild
  the smaller model from the checkpoint's spec (stop=1: and apply the pending batch change).
  """
  make_hook = (lambda: _BatchAndWidthHook()) if reconfigure else (lambda: None)
  use_data = not reconfigure
  straight = _run(tmp_path / "a", 4, make_hook(), use_data)
  _run(tmp_path / "b", stop, make_hook(), use_data)  # stop after `stop` epochs ...
  resumed = _run(tmp_path / "b", 4, make_hook(), use_data)  # ... fresh trainer, resume, finish
  assert resumed.epoch == 4 and resumed.step == straight.step
  assert _strip_timing(resumed.history) == _strip_timing(straight.history)
  _assert_trees_equal(nnx.as_pure(nnx.state(resumed.model)), nnx.as_pure(nnx.state(straight.model)))
  _assert_trees_equal(resumed.opt_state, straight.opt_state)
  logged = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
  assert [r["epoch"] for r in logged] == [1, 2, 3, 4]
  # the run actually trained (resume of an untrained model would pass trivially)
  assert straight.history[-1]["train_loss"] < straight.history[0]["train_loss"]


def test_interrupted_checkpoint_write_is_not_resumed(tmp_path, monkeypatch):
  import orbax.checkpoint as ocp

  images, labels = _data(48)
  loader = ArrayLoader(images, labels, 8)
  trainer = _trainer(checkpoint_dir=tmp_path / "ckpt")
  trainer.fit(loader, epochs=1)
  good_params = jax.tree.map(np.asarray, trainer.params)

  # Interrupt the next save after the arrays were written but before the metadata
  # and the final rename (as a crash or kill mid-write would).
  def crash(*args, **kwargs):
    raise KeyboardInterrupt("simulated crash during checkpoint write")

  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "save", crash)
  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "async_save", crash, raising=False)
  with pytest.raises(KeyboardInterrupt):
    trainer.fit(loader, epochs=2)
  monkeypatch.undo()
  leftovers = sorted(os.listdir(tmp_path / "ckpt"))
  assert "1" in leftovers and "2" not in leftovers, leftovers
  fresh = _trainer(_model(seed=9), checkpoint_dir=tmp_path / "ckpt")
  assert fresh.store.latest_step() == 1
  assert fresh.restore_checkpoint(loader)
  assert fresh.epoch == 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fresh.params), good_params)


def test_resume_refuses_a_differently_configured_run(tmp_path):
  images, labels = _data(48)
  loader = ArrayLoader(images, labels, 8)
  ckpt = tmp_path / "ckpt"
  _trainer(checkpoint_dir=ckpt, run_config={"epochs": 3, "milestones": (2,)}).fit(loader, epochs=1)
  # the same config (a tuple stored as a JSON list still compares equal) resumes
  same = _trainer(_model(seed=9), checkpoint_dir=ckpt, run_config={"epochs": 3, "milestones": [2]})
  assert same.restore_checkpoint(loader) and same.epoch == 1
  other = _trainer(
    _model(seed=9), checkpoint_dir=ckpt, run_config={"epochs": 10, "milestones": [5]}
  )
  with pytest.raises(ValueError, match=r"run_config.*epochs: checkpoint 3 vs now 10"):
    other.fit(loader, epochs=2)
  assert other.epoch == 0  # nothing was restored
  with pytest.raises(ValueError, match="run_config"):
    _trainer(run_config={"schedule": lambda step: 0.1})


def test_fresh_start_does_not_leave_the_old_runs_checkpoints_as_latest(tmp_path):
  images, labels = _data(48)
  loader = ArrayLoader(images, labels, 8)
  ckpt = tmp_path / "ckpt"
  _trainer(checkpoint_dir=ckpt).fit(loader, epochs=2)  # the old run: checkpoints 1 and 2
  fresh = _trainer(_model(seed=5), checkpoint_dir=ckpt)
  with pytest.raises(ValueError, match=r"checkpoint_dir .*ckpt already holds .*\[1, 2\]"):
    fresh.fit(loader, epochs=1, resume=False)
  assert fresh.epoch == 0 and fresh.store.all_steps() == [1, 2]  # refused before training
  fresh.fit(loader, epochs=1, resume=False, overwrite=True)
  assert fresh.store.all_steps() == [1]
  fresh.fit(loader, epochs=2, resume=False)  # going on with its own run is not refused
  # a later resume continues the fresh run, not the old one
  later = _trainer(_model(seed=9), checkpoint_dir=ckpt)
  assert later.restore_checkpoint(loader) and later.epoch == 2
  _assert_trees_equal(later.params, fresh.params)
  with pytest.raises(ValueError, match="overwrite"):
    later.fit(loader, epochs=2, overwrite=True)


def test_fit_to_fewer_epochs_than_the_checkpoint_holds_warns(tmp_path):
  images, labels = _data(48)
  loader = ArrayLoader(images, labels, 8)
  ckpt = tmp_path / "ckpt"
  _trainer(checkpoint_dir=ckpt).fit(loader, epochs=3)
  resumed = _trainer(_model(seed=9), checkpoint_dir=ckpt)
  with pytest.warns(UserWarning, match=r"epochs=2.*already at epoch 3.*ckpt"):
    history = resumed.fit(loader, epochs=2)
  assert len(history) == 3 and resumed.epoch == 3 and resumed.store.latest_step() == 3


def _two_checkpoints(tmp_path):
  """A tiny run's checkpoints 1 and 2; returns the loader, the folder, epoch 1's params."""
  loader = ArrayLoader(*_data(48), 8)
  trainer = _trainer(checkpoint_dir=tmp_path / "ckpt")
  trainer.fit(loader, epochs=1)
  params1 = jax.tree.map(np.asarray, trainer.params)
  trainer.fit(loader, epochs=2)
  return loader, tmp_path / "ckpt", params1


def _damage(step_dir, how):
  if how == "delete_item":  # a missing item: a bare KeyError before
    shutil.rmtree(step_dir / "arrays")
    return
  # a truncated array file: the arrays' JSON metadata (a bare JSONDecodeError before) or
  # the array data themselves
  files = [step_dir / "arrays" / "_METADATA"]
  if how == "truncate_data":
    files = [p for p in (step_dir / "arrays" / "d").iterdir()]
  for path in files:
    with open(path, "r+b") as f:
      f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("how", ["truncate_metadata", "truncate_data", "delete_item"])
def test_damaged_newest_checkpoint_is_named_and_the_newest_intact_one_resumed(tmp_path, how):
  loader, ckpt, params1 = _two_checkpoints(tmp_path)
  _damage(ckpt / "2", how)
  fresh = _trainer(_model(seed=9), checkpoint_dir=ckpt)
  with pytest.warns(UserWarning, match=r"checkpoint 2 at \S*ckpt/2 is damaged.*from checkpoint 1"):
    assert fresh.restore_checkpoint(loader)
  assert fresh.epoch == 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fresh.params), params1)
  # set aside, so the resumed run writes epoch 2 again
  assert fresh.store.all_steps() == [1] and (ckpt / "2.damaged").is_dir()
  fresh.fit(loader, epochs=2)
  assert fresh.store.all_steps() == [1, 2]


def test_no_intact_checkpoint_refuses_naming_each_damaged_one(tmp_path):
  loader, ckpt, _ = _two_checkpoints(tmp_path)
  _damage(ckpt / "2", "truncate_metadata")
  _damage(ckpt / "1", "delete_item")
  fresh = _trainer(_model(seed=9), checkpoint_dir=ckpt)
  with pytest.raises(
    jt.DamagedCheckpointError, match=r"checkpoint 2 at .*no intact.*checkpoint 1 at \S*ckpt/1"
  ):
    fresh.fit(loader, epochs=2)
  assert fresh.epoch == 0 and fresh.store.all_steps() == [1, 2]  # nothing restored or moved


def test_checkpoint_store_rejects_wrong_shapes(tmp_path):
  store = jt.CheckpointStore(tmp_path / "c")
  store.save(1, {"a": {"w": jnp.ones((2, 3))}}, {"epoch": 1})
  with pytest.raises(ValueError) as wrong_shape:
    store.restore(1, {"a": {"w": jnp.ones((4, 3))}})
  with pytest.raises(
    ValueError, match=r"template.*not in the checkpoint \[\"\['a'\]\['v'\]\"\]"
  ) as extra:
    store.restore(1, {"a": {"w": jnp.ones((2, 3)), "v": jnp.ones(2)}})
  # a template that does not fit is not the checkpoint's damage
  assert not isinstance(wrong_shape.value, jt.DamagedCheckpointError)
  assert not isinstance(extra.value, jt.DamagedCheckpointError)
  arrays, meta = store.restore(1, {"a": {"w": jnp.zeros((2, 3))}})
  np.testing.assert_array_equal(arrays["a"]["w"], np.ones((2, 3)))
  assert meta == {"epoch": 1}


def test_spec_json_round_trip():
  spec = TinySpec((7, 9))
  data = json.loads(json.dumps(encode_spec(spec)))
  assert decode_spec(data) == spec
  with pytest.raises(ValueError, match="spec"):
    encode_spec(object())


# ----------------------------------------------------------------------------- runner


def test_experiment_runner_lists_and_rejects_unknown(capsys):
  from experiments import run

  assert {"quickstart", "cifar_baseline"} <= set(run.available())
  assert "run" not in run.available()
  assert run.main(["--list"]) == 0
  assert "quickstart" in capsys.readouterr().out.split()
  with pytest.raises(ValueError, match="unknown experiment 'no_such_experiment'"):
    run.load("no_such_experiment")
  assert run.main(["no_such_experiment"]) == 2
  assert "unknown experiment" in capsys.readouterr().err


def test_quickstart_rejects_unknown_method_and_formats_rows():
  from experiments import quickstart

  with pytest.raises(SystemExit):
    quickstart._parse(["--methods", "dense,no_such_method"])
  assert "dense" in quickstart.METHODS
  table = quickstart.format_table(
    [{"method": "dense", "test_acc": 0.5, "compression": 1.0, "train_time_s": 3.0}]
  )
  assert "| dense | 50.00% | 1.00x | 3.0 |" in table.splitlines()


def test_bool_epochs_is_rejected_not_one_epoch():
  images, labels = _data(8)
  trainer = _trainer()
  with pytest.raises(ValueError, match="epochs"):
    trainer.fit(ArrayLoader(images, labels, 4), epochs=True)
  assert trainer.epoch == 0

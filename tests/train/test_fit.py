"""Trainer.fit: learning and JSON lines, non-finite steps, timing, hooks (batch size, LR, model
replacement, step and epoch hooks), the experiment runner."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxprune.train as jt

# ----------------------------------------------------------------------------- fit / hooks


def test_fit_learns_and_writes_json_lines(tmp_path, kit):
  images, labels = kit.data(48)
  log = tmp_path / "log.jsonl"
  trainer = jt.fit(
    kit.model(),
    kit.TX,
    kit.ArrayLoader(images, labels, 8),
    kit.ArrayLoader(images[:16], labels[:16], 8, shuffle=False),
    epochs=4,
    log_path=log,
    label_smoothing=kit.SMOOTHING,
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


def test_nonfinite_step_is_left_out_of_the_epoch_loss_and_counted(kit):
  # One NaN batch of four: the epoch's train loss / accuracy are those of the three finite
  # batches (a plain loop over the model), the NaN step is counted and warned about.
  images, labels = kit.data(32)
  images[16] = np.nan  # batch 2 of 4 (no shuffle): BatchNorm spreads it to the whole batch
  model = kit.model(dropout=0.0)
  reference = nnx.clone(model)
  reference.train()  # batch statistics: the loss does not depend on the running averages
  losses, correct = [], 0
  for b in (0, 1, 3):  # lr 0: the params stay the initial ones
    x, y = jnp.asarray(images[8 * b : 8 * b + 8]), jnp.asarray(labels[8 * b : 8 * b + 8])
    logits = reference(x)
    losses.append(float(jt.cross_entropy(logits, y)))
    correct += int(np.sum(np.argmax(np.asarray(logits), -1) == labels[8 * b : 8 * b + 8]))
  trainer = jt.Trainer(model, optax.apply_if_finite(optax.sgd(0.0), 5))
  # Both warnings: the non-finite step, and the batch whose images are not finite.
  with (
    pytest.warns(RuntimeWarning, match=r"train batch 3 of 4 .* inputs are not finite"),
    pytest.warns(RuntimeWarning, match="epoch 1: 1 of 4 train steps had a non-finite loss"),
  ):
    (record,) = trainer.fit(kit.ArrayLoader(images, labels, 8, shuffle=False), epochs=1)
  assert record["nonfinite_steps"] == 1
  np.testing.assert_allclose(record["train_loss"], np.mean(losses), rtol=1e-5)
  assert record["train_acc"] == pytest.approx(correct / 24)
  # The NaN step leaves BatchNorm's running statistics as they were: the plain loop's, which
  # saw only the finite batches (without the guard every one would be NaN).
  want = jax.tree.leaves(nnx.state(reference, nnx.BatchStat))
  got = jax.tree.leaves(nnx.state(trainer.model, nnx.BatchStat))
  assert len(got) == len(want) > 0
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_epoch_cpu_time_counts_the_process_cpu_seconds(kit):
  images, labels = kit.data(48)
  loader = kit.BusyLoader(images, labels, 8)
  trainer = kit.trainer()
  trainer.train_epoch(loader)  # compile outside the measured epoch
  before = time.process_time()
  record = trainer.train_epoch(loader)
  outer = time.process_time() - before
  # the loader's busy loop is CPU time of the process; sleeping would not be
  assert len(loader) * kit.BusyLoader.busy_s <= record["cpu_time_s"] <= outer


def test_empty_loader_is_an_error(kit):
  images, labels = kit.data(8)
  trainer = kit.trainer()
  with pytest.raises(ValueError, match="no batches"):
    trainer.fit(kit.ArrayLoader(images, labels, 16), epochs=1)  # batch > dataset, drop_last
  with pytest.raises(ValueError, match="epochs"):
    trainer.fit(kit.ArrayLoader(images, labels, 4), epochs=0)


def test_hooks_change_batch_size_lr_and_model(kit):
  images, labels = kit.data(48)
  loader = kit.ArrayLoader(images, labels, 8)
  hook = kit.BatchAndWidthHook()
  trainer = kit.trainer(callbacks=[hook])
  history = trainer.fit(loader, epochs=2)
  assert hook.calls == [1, 2]
  assert [r["hook_epoch"] for r in history] == [1, 2]
  assert [r["batch_size"] for r in history] == [8, 16]
  assert [r["steps"] for r in history] == [6, 3]
  assert trainer.lr_scale == pytest.approx(2.0)
  # schedule positions 6, 8, 10 are before the epoch-2 milestone (12): base 0.1 x scale 2
  assert history[1]["lr"] == pytest.approx(0.2)
  assert trainer.model.spec == kit.TinySpec((3,))
  assert trainer.model.c1.kernel.shape == (3, 3, 1, 3)
  # schedule advances by 16/8 = 2 reference steps per step after the batch change
  (lr_state,) = kit.lr_states(trainer.opt_state)
  assert float(lr_state.step_increment) == pytest.approx(2.0)
  assert float(lr_state.step) == pytest.approx(6 + 3 * 2.0)


def test_replace_rejects_mismatched_optimizer_state(kit):
  trainer = kit.trainer()
  narrow = kit.model(spec=kit.TinySpec((3,)))
  with pytest.raises(ValueError, match="opt_state"):
    trainer.replace(narrow, trainer.opt_state)  # state still shaped for width 4
  trainer.replace(narrow, kit.TX.init(nnx.as_pure(nnx.state(narrow, nnx.Param))))
  assert trainer.params["c1"]["kernel"].shape == (3, 3, 1, 3)


def test_step_hook_runs_every_k_steps(kit):
  images, labels = kit.data(48)
  seen = []

  class Every3(jt.Callback):
    every_steps = 3

    def on_step(self, trainer, step):
      seen.append(step)
      trainer.lr_scale = 0.5

  trainer = kit.trainer(callbacks=[Every3()], progress=True)  # also runs the tqdm path
  history = trainer.fit(kit.ArrayLoader(images, labels, 8), epochs=1)
  assert seen == [3, 6]
  assert history[0]["lr"] == pytest.approx(0.05)  # the last steps ran at 0.1 x 0.5


def test_train_epoch_end_hook_runs_after_training_before_evaluation(kit):
  images, labels = kit.data(48)
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

  class LoggedTestLoader(kit.ArrayLoader):
    def __iter__(self):
      events.append(("evaluate",))
      return super().__iter__()

  loader = kit.ArrayLoader(images, labels, 8)
  history = kit.trainer(callbacks=[Probe()]).fit(
    loader, LoggedTestLoader(images, labels, 8, shuffle=False), epochs=1
  )
  assert events == [("train_end", 1, 6, True), ("evaluate",), ("epoch_end", 1, 6)]
  # Zero logits: the (smoothed) cross-entropy of a uniform prediction over 3 classes.
  assert history[0]["test_loss"] == pytest.approx(np.log(3.0), rel=1e-5)


def test_bool_epochs_is_rejected_not_one_epoch(kit):
  images, labels = kit.data(8)
  trainer = kit.trainer()
  with pytest.raises(ValueError, match="epochs"):
    trainer.fit(kit.ArrayLoader(images, labels, 4), epochs=True)
  assert trainer.epoch == 0


# ----------------------------------------------------------------------------- progress


def test_off_a_terminal_fit_prints_one_line_per_epoch(kit, capsys, monkeypatch):
  images, labels = kit.data(16)
  loaders = kit.ArrayLoader(images, labels, 8), kit.ArrayLoader(images, labels, 8, shuffle=False)
  # Under pytest stderr is captured: not a terminal.
  history = kit.trainer(eval_every=2).fit(*loaders, epochs=2)
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 2
  first, second = history
  assert lines[0].startswith(
    f"epoch 1/2  train_loss {first['train_loss']:.4f}  train_acc {first['train_acc']:.4f}  ("
  )
  assert "test_acc" not in lines[0]  # epoch 1 is not evaluated
  assert f"  test_acc {second['test_acc']:.4f}  (" in lines[1]
  # The first epoch of a fit also compiles the steps: its line says so, the next does not.
  assert lines[0].endswith(" s, compiling the steps included)")
  assert lines[1].endswith(" s)") and "compiling" not in lines[1]
  # progress=False prints nothing; on a terminal the bar replaces the lines.
  kit.trainer(progress=False).fit(*loaders, epochs=1)
  monkeypatch.setattr("jaxprune.train.trainer._is_tty", lambda: True)
  kit.trainer().fit(*loaders, epochs=1)
  assert capsys.readouterr().out == ""

"""The BatchNorm re-estimate at ClickTrain's hard prune: when it fires, what it computes (against
a NumPy recomputation), what it changes (evaluation, not training) and the preset's default."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain, methods, train

SPE = 6  # digits_loader(): 96 images, batch 16


def _conv_same(x, kernel):
  """NumPy 3x3 stride-1 SAME convolution, NHWC x HWIO, no bias."""
  h, w = x.shape[1], x.shape[2]
  padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  return sum(
    np.einsum("nhwc,cf->nhwf", padded[:, i : i + h, j : j + w], kernel[i, j])
    for i in range(3)
    for j in range(3)
  )


def _numpy_bn_stats(model, batches):
  """Average over ``batches`` of the per-channel batch mean / biased variance of the BatchNorm's
  input, conv1(relu(stem(x))), from the model's kernels in float64."""
  stem = np.asarray(model.stem.kernel[...], np.float64)
  conv1 = np.asarray(model.conv1.kernel[...], np.float64)
  means, variances = [], []
  for images, _ in batches:
    out = _conv_same(np.maximum(_conv_same(np.asarray(images, np.float64), stem), 0.0), conv1)
    means.append(out.mean((0, 1, 2)))
    variances.append(out.var((0, 1, 2)))
  return np.mean(means, 0), np.mean(variances, 0)


def _fit(tiny_cnn, digits_loader, hooks, epochs):
  model = tiny_cnn(num_classes=4)
  model.bn.momentum = 0.9  # PyTorch's 0.1, as jaxprune.models uses: about the last ten steps
  tx = clicktrain.clicktrain(
    optax.sgd(0.05, momentum=0.9),
    steps_per_epoch=SPE,
    mode="one_shot",
    one_shot_epoch=1,
    hard_prune_epoch=3,
    kernel_prune_ratio=0.75,
  )
  trainer = train.Trainer(model, tx, callbacks=hooks, progress=False)
  loader = digits_loader()
  history = trainer.fit(loader, digits_loader(seed=1, shuffle=False), epochs=epochs)
  return trainer, history, loader


def test_statistics_are_re_estimated_at_the_hard_prune_and_evaluation_improves(
  tiny_cnn, digits_loader
):
  hook = clicktrain.HardPruneBatchNorm(num_batches=3)
  with_hook, history, loader = _fit(tiny_cnn, digits_loader, [hook], epochs=4)
  # It fired once, at the first epoch end whose state says "pruned" (the last step of epoch 3,
  # before hard_prune_epoch=3 counted from 0, zeroed the pruned weights), and said so in that
  # epoch's record.
  prune_epoch = hook.recomputed_at
  assert prune_epoch == 3
  assert [r.get("ct_bn_recomputed", False) for r in history] == [False, False, True, False]
  assert clicktrain.stage_name(with_hook.opt_state) == "pruned"
  without, plain_history, _ = _fit(tiny_cnn, digits_loader, [], epochs=4)
  # Training never reads running statistics: the same weights either way.
  for a, b in zip(
    jax.tree.leaves(nnx.state(with_hook.model, nnx.Param)),
    jax.tree.leaves(nnx.state(without.model, nnx.Param)),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Right after the hard prune the running averages still describe the dense weights: the
  # epoch evaluates better with the statistics of the pruned ones.
  after, plain_after = history[prune_epoch - 1], plain_history[prune_epoch - 1]
  assert after["test_loss"] < plain_after["test_loss"]
  assert after["test_acc"] >= plain_after["test_acc"]

  # The statistics are the plain average over the first 3 batches of the epoch just trained,
  # with the weights of that moment (a run stopped there: nothing trained since).
  stopped, _, _ = _fit(tiny_cnn, digits_loader, [clicktrain.HardPruneBatchNorm(3)], epochs=3)
  mean, var = _numpy_bn_stats(stopped.model, list(loader.iter_epoch(prune_epoch - 1))[:3])
  np.testing.assert_allclose(np.asarray(stopped.model.bn.mean[...]), mean, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(stopped.model.bn.var[...]), var, rtol=1e-4, atol=1e-5)


def test_a_fit_that_starts_after_the_prune_does_not_re_estimate(tiny_cnn, digits_loader):
  hook = clicktrain.HardPruneBatchNorm(num_batches=2)
  trainer, _, loader = _fit(tiny_cnn, digits_loader, [hook], epochs=3)
  assert hook.recomputed_at == 3
  before = np.asarray(trainer.model.bn.mean[...])
  fresh = clicktrain.HardPruneBatchNorm(num_batches=2)  # as a resumed run builds it
  trainer.callbacks = [fresh]
  (record,) = trainer.fit(loader, epochs=4)[3:]
  assert fresh.recomputed_at is None and record["ct_bn_recomputed"] is False
  # the running averages moved on by training alone
  assert not np.array_equal(np.asarray(trainer.model.bn.mean[...]), before)


def test_the_preset_adds_the_hook_by_default_and_a_key_turns_it_off():
  run = methods.Run(steps_per_epoch=3, epochs=10)

  def bn_hooks(method):
    return [h for h in method.callbacks(run) if isinstance(h, clicktrain.HardPruneBatchNorm)]

  for name in ("clicktrain", "clicktrain-one-shot", "clicktrain+sdgp"):
    (hook,) = bn_hooks(methods.get(name))
    assert hook.num_batches == 10
    assert bn_hooks(methods.get(name, recompute_batchnorm=0)) == []
  assert bn_hooks(methods.get("clicktrain", recompute_batchnorm=4))[0].num_batches == 4
  assert methods.get("clicktrain", recompute_batchnorm=4).config == {"recompute_batchnorm": 4}
  # the released configs take it too, and still build their transform
  released = clicktrain.released_method("vgg11", recompute_batchnorm=0)
  assert bn_hooks(released) == []
  released.make_tx(optax.sgd(0.1), run)
  for bad in (-1, True, 1.5):
    with pytest.raises(ValueError, match="recompute_batchnorm"):
      methods.get("clicktrain", recompute_batchnorm=bad)
    with pytest.raises(ValueError, match="num_batches"):
      clicktrain.HardPruneBatchNorm(num_batches=bad)


def test_a_run_that_ends_before_the_hard_prune_warns_at_its_last_epoch(tiny_cnn, digits_loader):
  import warnings

  # The run: hard_prune_epoch=3, a 4-epoch fit, the default 5 + 5 stages after the
  # trigger: it ends dense, and the preset's check says so at the last epoch.
  run = methods.Run(steps_per_epoch=SPE, epochs=4)
  method = methods.get("clicktrain", hard_prune_epoch=3, recompute_batchnorm=0)
  with pytest.warns(RuntimeWarning, match="ends before its hard prune"):
    tx = method.make_tx(optax.sgd(0.0), run)  # a flat loss: the trigger fires at epoch 2
  # The end-of-run check, the pruned stage's step, then the layer choice's fit-start check.
  check, pruned_step, layers = method.callbacks(run)
  assert isinstance(check, clicktrain.HardPruneCheck) and check.epochs == 4
  assert isinstance(pruned_step, clicktrain.PrunedStageStep)
  assert isinstance(layers, clicktrain.LayerChoiceCheck)
  trainer = train.Trainer(tiny_cnn(num_classes=4), tx, callbacks=[check], progress=False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.fit(digits_loader(), epochs=4)
  ended = [str(w.message) for w in caught if "the run ended" in str(w.message)]
  stage = clicktrain.stage_name(trainer.opt_state)
  assert stage != "pruned"
  assert ended == [
    (
      f"clicktrain: the run ended after 4 epochs before the hard prune, in stage {stage!r}: "
      "the model is dense (compression 1.0); the loss-derivative trigger fired too late, or "
      "not at all, for pool_epochs + finalize_epochs + 1 epochs before the end (set "
      "pool_start_epoch, shorten the stages or train longer)"
    )
  ]
  with pytest.raises(ValueError, match="epochs must be a positive int"):
    clicktrain.HardPruneCheck(0)


def test_a_run_pruned_by_its_end_does_not_warn(tiny_cnn, digits_loader):
  import warnings

  check = clicktrain.HardPruneCheck(4)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer, history, loader = _fit(tiny_cnn, digits_loader, [check], epochs=4)
  assert clicktrain.stage_name(trainer.opt_state) == "pruned"
  assert not [w for w in caught if "the run ended" in str(w.message)]
  # One epoch convention: hard_prune_epoch=3 counts completed epochs, the records count from
  # 1, so the record marked epoch 3 is the one that ended with the prune; every record has the
  # keys. one_shot_epoch=1: the first batch of epoch 2 picks the masks.
  assert [r["epoch"] for r in history if r["ct_hard_prune"]] == [3]
  assert [r["ct_stage"] for r in history] == ["warmup", "regularize", "pruned", "pruned"]
  # A fit resumed after the prune marks nothing again.
  (record,) = trainer.fit(loader, epochs=5)[4:]
  assert record["ct_hard_prune"] is False and record["ct_stage"] == "pruned"


@pytest.mark.parametrize(
  "settings, cause",
  [
    # Only the paper mode without pool_start_epoch waits for the loss-derivative trigger.
    ({}, "the loss-derivative trigger fired too late, or not at all"),
    (
      {"pool_start_epoch": 1, "hard_prune_epoch": 12},
      "with pool_start_epoch=1 (a fixed schedule) the hard prune comes after 12 epochs at the "
      "earliest, later than the run's end",
    ),
    (
      {"pool_start_epoch": 0, "pool_epochs": 1, "finalize_epochs": 1, "hard_prune_epoch": 3},
      "with pool_start_epoch=0 (a fixed schedule) the hard prune was due after 3 epochs, so a "
      "stage was extended",
    ),
    (
      {"mode": "one_shot", "one_shot_epoch": 0, "hard_prune_epoch": 6},
      "with mode='one_shot' (a fixed schedule) the hard prune comes after 6 epochs",
    ),
  ],
)
def test_the_end_of_run_warning_names_the_schedules_cause(tiny_cnn, settings, cause):
  import types

  model = tiny_cnn(num_classes=4)
  kw = {"hard_prune_epoch": 5, **settings}
  tx = clicktrain.clicktrain(optax.sgd(0.1), steps_per_epoch=SPE, **kw)
  trainer = types.SimpleNamespace(epoch=4, opt_state=tx.init(nnx.state(model, nnx.Param)))
  with pytest.warns(RuntimeWarning, match="the run ended after 4 epochs") as caught:
    clicktrain.HardPruneCheck(4).after_epoch(trainer, {})
  (message,) = [str(w.message) for w in caught if "the run ended" in str(w.message)]
  assert cause in message, message
  if settings:  # a fixed schedule: the trigger is not to blame
    assert "loss-derivative trigger" not in message

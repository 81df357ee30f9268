"""The read-out just before ClickTrain's hard prune: the removed share of the weight norm against
a hand count, the masked copy's accuracy against a model masked by hand, when the hook fires,
that training does not notice it, and its errors."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain, train

SPE = 6  # digits_loader(): 96 images, batch 16
HARD_PRUNE = 3  # the prune ends epoch 3; the reading is taken at the end of epoch 2
KEYS = (
  "hard_prune_removed_norm_fraction",
  "hard_prune_removed_norm_fraction_by_layer",
  "hard_prune_test_acc_before",
  "hard_prune_test_acc_after_no_bn",
  "hard_prune_test_acc_after",
)


@functools.cache
def _tx(mode="one_shot"):
  """One transform per mode, shared by the runs: the trainer's compiled steps are cached per
  (model structure, transform), so a second run of a test compiles nothing."""
  stages = (
    {"one_shot_epoch": 1}
    if mode == "one_shot"
    else {"pool_start_epoch": 0, "pool_epochs": 1, "finalize_epochs": 1}
  )
  return clicktrain.clicktrain(
    optax.sgd(0.05, momentum=0.9),
    steps_per_epoch=SPE,
    mode=mode,
    hard_prune_epoch=HARD_PRUNE,
    kernel_prune_ratio=0.5,
    **stages,
  )


def _fit(tiny_cnn, digits_loader, hooks, epochs, mode="one_shot"):
  model = tiny_cnn(num_classes=4)
  model.bn.momentum = 0.9
  trainer = train.Trainer(model, _tx(mode), callbacks=hooks, progress=False)
  loader, test_loader = digits_loader(), digits_loader(seed=1, shuffle=False)
  trainer.fit(loader, test_loader, epochs=epochs)
  return trainer, loader, test_loader


def _hand_accuracy(model, test_loader):
  """Eval-mode accuracy of ``model`` over ``test_loader``, counted in NumPy."""
  model.eval()
  correct = total = 0
  for images, labels in test_loader:
    logits = np.asarray(model(jnp.asarray(images)))
    correct += int(np.sum(np.argmax(logits, -1) == np.asarray(labels)))
    total += len(labels)
  return correct / total


def test_removed_norm_fraction_matches_a_hand_count(kit):
  params = kit.params()
  tx = clicktrain.clicktrain(optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=5)
  state = tx.init(params)
  assert set(state.layers) == {kit.CONV1, kit.CONV2}
  # a fresh state's masks (all ones) remove nothing
  assert clicktrain.removed_norm_fraction(state, params) == (0.0, {kit.CONV1: 0.0, kit.CONV2: 0.0})
  # Planted masks: conv1 (3x3, 6 -> 8) keeps the top row of each kernel (pattern) and drops
  # input channel 0 (kernels); conv2 (1x1, 8 -> 8) drops output filter 3.
  pattern = np.zeros((3, 3, 6, 8), np.float32)
  pattern[0] = 1.0
  keep1 = np.ones((6, 8), bool)
  keep1[0] = False
  keep2 = np.ones((8, 8), bool)
  keep2[:, 3] = False
  layers = dict(state.layers)
  layers[kit.CONV1] = layers[kit.CONV1]._replace(
    pattern_mask=jnp.asarray(pattern), kernel_keep=jnp.asarray(keep1)
  )
  layers[kit.CONV2] = layers[kit.CONV2]._replace(kernel_keep=jnp.asarray(keep2))
  state = state._replace(layers=layers)

  # By hand: the prune removes rows 1-2 of every conv1 kernel plus row 0 of input channel 0,
  # and conv2's column 3; the stem, the shortcut and the head are not ClickTrain's.
  w1 = np.asarray(params["block"]["conv1"]["kernel"], np.float64)
  w2 = np.asarray(params["block"]["conv2"]["kernel"], np.float64)
  r1 = np.sum(w1[1:] ** 2) + np.sum(w1[0, :, 0] ** 2)
  r2 = np.sum(w2[..., 3] ** 2)
  n1, n2 = np.sum(w1**2), np.sum(w2**2)
  total, by_layer = clicktrain.removed_norm_fraction(state, params)
  assert total == pytest.approx((r1 + r2) / (n1 + n2), rel=1e-12)
  assert by_layer == pytest.approx({kit.CONV1: r1 / n1, kit.CONV2: r2 / n2}, rel=1e-12)
  # inside a chain, and an NNX State of the same params
  chained = (optax.EmptyState(), state)
  assert clicktrain.removed_norm_fraction(chained, nnx.State(params))[0] == total
  with pytest.raises(ValueError, match="params: no 'block/conv2/kernel'"):
    clicktrain.removed_norm_fraction(state, {"block": {"conv1": {"kernel": w1}}})


def test_reads_out_once_before_the_prune_from_copies_of_the_state(tiny_cnn, digits_loader):
  test_loader = digits_loader(seed=1, shuffle=False)
  readout = clicktrain.HardPruneReadout(test_loader, hard_prune_epoch=HARD_PRUNE, bn_batches=3)
  # Stopped at the reading first: the trainer holds the weights it was taken from.
  trainer, loader, _ = _fit(tiny_cnn, digits_loader, [readout], epochs=HARD_PRUNE - 1)
  record = trainer.history[-1]
  assert readout.fired_at == HARD_PRUNE - 1
  assert clicktrain.stage_name(trainer.opt_state) == "regularize"
  assert all(k in record for k in KEYS)
  # The "before" accuracy is the epoch's own evaluation (the same test loader).
  assert record["hard_prune_test_acc_before"] == pytest.approx(record["test_acc"])
  assert 0.0 < record["hard_prune_removed_norm_fraction"] < 1.0
  total, by_layer = clicktrain.removed_norm_fraction(trainer.opt_state, trainer.params)
  assert record["hard_prune_removed_norm_fraction"] == total
  assert record["hard_prune_removed_norm_fraction_by_layer"] == by_layer
  assert set(by_layer) == {"conv1/kernel", "conv2/kernel"}

  # "after": the accuracy of a model masked by hand, without and with the statistics of the
  # masked weights from 3 batches of the epoch just trained.
  st = clicktrain.find_state(trainer.opt_state)
  model = nnx.clone(trainer.model)
  for name, module in (("conv1/kernel", model.conv1), ("conv2/kernel", model.conv2)):
    ls = st.layers[name]
    mask = np.asarray(ls.pattern_mask) * np.asarray(ls.kernel_keep)
    module.kernel[...] = jnp.asarray(np.asarray(module.kernel[...]) * mask)
  assert _hand_accuracy(nnx.clone(model), test_loader) == pytest.approx(
    record["hard_prune_test_acc_after_no_bn"]
  )
  train.recompute_batch_stats(model, loader.iter_epoch(HARD_PRUNE - 2), 3)
  assert _hand_accuracy(model, test_loader) == pytest.approx(record["hard_prune_test_acc_after"])

  # On through the prune: no more readings, and no warning (the prune came where expected).
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    trainer.fit(loader, test_loader, epochs=HARD_PRUNE, resume=False)
  assert clicktrain.stage_name(trainer.opt_state) == "pruned"
  assert readout.fired_at == HARD_PRUNE - 1
  assert [any(k in r for k in KEYS) for r in trainer.history] == [False, True, False]

  # The hook read copies: params, BatchNorm statistics, optimizer state and the records'
  # training and evaluation entries are those of a run without it.
  without, _, _ = _fit(tiny_cnn, digits_loader, [], epochs=HARD_PRUNE)
  for a, b in zip(
    jax.tree.leaves((trainer.params, trainer.rest, trainer.opt_state)),
    jax.tree.leaves((without.params, without.rest, without.opt_state)),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for r, s in zip(trainer.history, without.history, strict=True):
    for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
      assert r[key] == s[key]


def test_paper_mode_fires_before_the_prune_and_a_wrong_epoch_warns(tiny_cnn, digits_loader):
  # Paper mode: pool (epoch 1), finalization (epoch 2), the masks final at its end, the
  # prune at the end of epoch 3.
  test_loader = digits_loader(seed=1, shuffle=False)
  right = clicktrain.HardPruneReadout(test_loader, hard_prune_epoch=HARD_PRUNE, bn_batches=2)
  late = clicktrain.HardPruneReadout(test_loader, hard_prune_epoch=HARD_PRUNE + 2, bn_batches=2)
  with pytest.warns(UserWarning, match="no reading was taken at the end of epoch 2") as caught:
    trainer, _, _ = _fit(tiny_cnn, digits_loader, [right, late], HARD_PRUNE, mode="paper")
  assert sum("HardPruneReadout" in str(w.message) for w in caught) == 1  # from `late` only
  assert (right.fired_at, late.fired_at) == (HARD_PRUNE - 1, None)
  assert [any(k in r for k in KEYS) for r in trainer.history] == [False, True, False]


def test_a_dense_run_is_refused_at_fit_start(tiny_cnn, digits_loader):
  readout = clicktrain.HardPruneReadout(digits_loader(shuffle=False), hard_prune_epoch=2)
  trainer = train.Trainer(tiny_cnn(), optax.sgd(0.1), callbacks=[readout], progress=False)
  with pytest.raises(ValueError, match="HardPruneReadout.*no ClickTrainState"):
    trainer.fit(digits_loader(), epochs=1)
  assert trainer.epoch == 0


def test_bad_arguments_are_named(digits_loader):
  loader = digits_loader(shuffle=False)
  for bad in (None, 3, "data"):
    with pytest.raises(ValueError, match="test_loader"):
      clicktrain.HardPruneReadout(bad, hard_prune_epoch=2)
    if bad is not None:
      with pytest.raises(ValueError, match="train_loader"):
        clicktrain.HardPruneReadout(loader, hard_prune_epoch=2, train_loader=bad)
  for bad in (-1, True, 1.5):  # None: the transform's, read from its state
    with pytest.raises(ValueError, match="hard_prune_epoch"):
      clicktrain.HardPruneReadout(loader, hard_prune_epoch=bad)
  for bad in (0, -1, True, 2.0):
    with pytest.raises(ValueError, match="bn_batches"):
      clicktrain.HardPruneReadout(loader, hard_prune_epoch=2, bn_batches=bad)

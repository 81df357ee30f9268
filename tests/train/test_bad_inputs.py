"""What the trainer does with bad input: a NaN pixel whose loss stays finite, class ids outside
the model's outputs, images with the wrong channel count, and arrays shared with ``nnx.clone``
copies of a model whose state the step donates."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxprune.train as jt


class _NanSafeNet(nnx.Module):
  """Conv, BatchNorm, a select that replaces NaN activations by 0, a linear head.

  One NaN pixel makes BatchNorm's batch statistics NaN, the select keeps the logits (and the
  loss) finite, and the gradients are NaN (0 · NaN in the backward pass): the case a guard on
  the loss alone misses.
  """

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.nan_to_num(self.bn(self.conv(x))).mean((1, 2)))


def _numpy(tree):
  """A host copy of ``tree`` (random keys as their key data)."""

  def host(x):
    is_key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    return np.array(jax.random.key_data(x) if is_key else x)

  return jax.tree.map(host, tree)


def test_nan_pixel_with_a_finite_loss_is_a_counted_nonfinite_step(kit):
  images, labels = kit.data(32)
  images[17, 2, 2, 0] = np.nan  # one pixel of batch 3 of 4 (no shuffle)
  bad = slice(16, 24)
  # The case itself: the loss of that batch is finite, its gradients are not.
  probe = _NanSafeNet(nnx.Rngs(0))
  loss, grads = nnx.value_and_grad(lambda m: jt.cross_entropy(m(images[bad]), labels[bad]))(probe)
  assert np.isfinite(loss)
  assert not all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))

  # Reference: a plain loop over the three finite batches (SGD by hand, BatchNorm in train
  # mode updating its running statistics).
  reference = _NanSafeNet(nnx.Rngs(0))
  reference.train()
  for b in (0, 1, 3):
    x, y = images[8 * b : 8 * b + 8], labels[8 * b : 8 * b + 8]
    _, g = nnx.value_and_grad(lambda m, x=x, y=y: jt.cross_entropy(m(x), y))(reference)
    params = nnx.state(reference, nnx.Param)
    nnx.update(reference, jax.tree.map(lambda p, d: p - 0.1 * d, params, g))

  trainer = jt.Trainer(_NanSafeNet(nnx.Rngs(0)), optax.apply_if_finite(optax.sgd(0.1), 5))
  loader = kit.ArrayLoader(images, labels, 8, shuffle=False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    (record,) = trainer.fit(loader, epochs=1)
  messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
  assert record["nonfinite_steps"] == 1
  assert any("1 of 4 train steps had a non-finite loss or gradient" in m for m in messages)
  assert any(
    "train batch 3 of 4" in m and "first whose inputs are not finite" in m for m in messages
  )
  # Params (skipped by apply_if_finite) and BatchNorm's running statistics (kept by the
  # trainer) are the plain loop's, which never saw the NaN batch.
  for kind in (nnx.Param, nnx.BatchStat):
    want = jax.tree.leaves(nnx.state(reference, kind))
    got = jax.tree.leaves(nnx.state(trainer.model, kind))
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)

  # The input warning is shown once per trainer; the count of non-finite steps every epoch.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.fit(loader, epochs=2)
  messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
  assert any("epoch 2: 1 of 4 train steps" in m for m in messages)
  assert not any("inputs are not finite" in m for m in messages)


def test_out_of_range_labels_are_named_as_the_cause_of_a_nonfinite_step(kit):
  images, labels = kit.data(32)  # 3 classes: the model has 3 outputs
  labels[20] = 5
  trainer = jt.Trainer(kit.model(), optax.apply_if_finite(optax.sgd(0.1), 5))
  with pytest.warns(
    RuntimeWarning,
    match=r"1 of 4 train steps had a non-finite loss or gradient; 1 of them had labels out of "
    r"range: class ids outside \[0, 3\)",
  ):
    (record,) = trainer.fit(kit.ArrayLoader(images, labels, 8, shuffle=False), epochs=1)
  assert record["nonfinite_steps"] == 1


def test_finite_steps_name_no_cause(kit):
  images, labels = kit.data(32)
  trainer = kit.trainer()
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    metrics = trainer.train_epoch(kit.ArrayLoader(images, labels, 8))
  assert metrics["nonfinite_steps"] == 0


def test_wrong_channel_count_is_a_value_error_naming_both_counts(kit):
  images, labels = kit.data(16)
  rgb = np.repeat(images, 3, axis=-1)  # the model's stem takes 1 channel
  trainer = kit.trainer()
  want = r"images: the batch has 3 channels \(shape \(8, 6, 6, 3\), NHWC\) but the model takes 1 "
  with pytest.raises(
    ValueError, match=want + r"input channel: .*models.create\(name, ..., in_channels=3\)"
  ):
    trainer.fit(kit.ArrayLoader(rgb, labels, 8), epochs=1)
  assert trainer.step == 0
  with pytest.raises(ValueError, match=want):
    trainer.evaluate(kit.ArrayLoader(rgb, labels, 8, shuffle=False))
  # Nothing was donated: the trainer goes on with the right images.
  trainer.fit(kit.ArrayLoader(images, labels, 8), epochs=1)
  assert trainer.step == 2


def test_donation_leaves_clones_of_the_model_intact(kit):
  images, labels = kit.data(32)
  loader = kit.ArrayLoader(images, labels, 8)
  model = kit.model()
  before = nnx.clone(model)  # shares the model's arrays
  want_before = _numpy(nnx.state(before))
  trainer = kit.trainer(model)  # donate=True
  trainer.fit(loader, epochs=1)
  after_one = nnx.clone(trainer.model)  # shares the trainer's (synced) arrays
  want_after_one = _numpy(nnx.state(after_one))
  trainer.fit(loader, epochs=2)
  # Reading a deleted array raises.
  kit.assert_trees_equal(_numpy(nnx.state(before)), want_before)
  kit.assert_trees_equal(_numpy(nnx.state(after_one)), want_after_one)
  # The run went on (the clones are not the trained state) and still donates: once its
  # state is its own (one epoch after the sync at the end of fit), the arrays a step is
  # given are gone after it.
  assert not np.array_equal(
    np.asarray(trainer.params["head"]["kernel"]), want_after_one["head"]["kernel"]
  )
  trainer.train_epoch(loader)
  given = trainer.params
  trainer.train_epoch(loader)
  assert all(x.is_deleted() for x in jax.tree.leaves(given))


class _OneBatch:
  """One batch, every epoch."""

  def __init__(self, images, labels):
    self.batch = (images, labels)

  def __iter__(self):
    yield self.batch


@pytest.mark.parametrize(
  "make_labels, message",
  [
    (lambda y: y[:7], r"labels: 7 rows \(shape \(7,\)\) for 8 images \(shape \(8, 6, 6, 1\)\)"),
    (
      lambda y: y.astype(np.float32),
      r"labels: class ids \[B\] must have an integer dtype \(e.g. int32\), got float32 \(shape \(8,",
    ),
    (
      lambda y: np.eye(3, dtype=np.int32)[y],
      r"labels: soft labels \[B, C\] must have a floating dtype \(e.g. float32\), got int32",
    ),
    (lambda y: y[:, None, None], r"labels: expected shape \[B\] .* got shape \(8, 1, 1\)"),
  ],
)
def test_labels_that_do_not_fit_the_batch_are_a_value_error_naming_them(kit, make_labels, message):
  images, labels = kit.data(8)
  trainer = kit.trainer()
  bad = _OneBatch(images, make_labels(labels))
  with pytest.raises(ValueError, match=message):
    trainer.fit(bad, epochs=1)
  assert trainer.step == 0
  with pytest.raises(ValueError, match=message):
    trainer.evaluate(bad)
  # Nothing was donated: the trainer goes on with labels that fit.
  trainer.fit(_OneBatch(images, labels), epochs=1)
  assert trainer.step == 1


def test_integer_images_warn_once_to_normalise(kit):
  images, labels = kit.data(8)
  raw = np.clip(images * 64 + 128, 0, 255).astype(np.uint8)
  trainer = kit.trainer()
  want = (
    r"images: the batch is uint8, so raw pixel values .* jaxprune.data.Loader, which normalises"
  )
  with pytest.warns(UserWarning, match=want):
    trainer.fit(_OneBatch(raw, labels), epochs=1)
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    trainer.fit(_OneBatch(raw, labels), epochs=2)  # once per trainer
    trainer.fit(_OneBatch(images, labels), epochs=3)  # float images: no warning

"""The JAX twins of the NumPy augmentations: the same output for the same draws, and draws
with the NumPy ones' statistics."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxprune.data import augment, device_augment

RGB = np.random.default_rng(0).integers(0, 256, (16, 12, 10, 3), dtype=np.uint8)
LABELS = np.arange(16, dtype=np.int32) % 10

CASES = [
  augment.RandomCrop(4),
  augment.RandomCrop(3, fill=(10, 200, 30)),
  augment.RandomTranslate(2, fill=7),
  augment.RandomHorizontalFlip(),
  augment.RandomHorizontalFlip(0.25),
  augment.Cutout(4, fill=(1, 2, 3)),
  augment.Cutout(5),
  augment.Mixup(0.3, num_classes=10),
]


@pytest.mark.parametrize("aug", CASES, ids=repr)
def test_same_output_as_numpy_for_the_same_draws(aug):
  params = device_augment.sample(aug, jax.random.key(3), RGB.shape)
  host_params = type(params)(*(np.asarray(v) for v in params))
  want_x, want_y = aug.apply(RGB, LABELS, host_params)
  got_x, got_y = device_augment.apply(aug, RGB, LABELS, params)
  assert np.asarray(got_x).dtype == want_x.dtype
  np.testing.assert_array_equal(np.asarray(got_x), want_x)
  np.testing.assert_array_equal(np.asarray(got_y), want_y)


@pytest.mark.parametrize("aug", CASES[:-1], ids=repr)
def test_twin_on_numpy_draws(aug):
  """The other way round: NumPy's own draws through the JAX twin."""
  params = aug.sample(np.random.default_rng(5), RGB.shape)
  want_x, _ = aug.apply(RGB, LABELS, params)
  got_x, _ = device_augment.apply(aug, RGB, LABELS, params)
  np.testing.assert_array_equal(np.asarray(got_x), want_x)


def test_normalize_matches_numpy():
  norm = augment.Normalize((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))
  want, _ = norm.apply(RGB, LABELS)
  got = np.asarray(device_augment.normalize(norm, RGB))
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_batch_function_replays_on_the_host():
  """A whole preset: the device batch equals the NumPy pipeline run on the device's draws."""
  pipeline = augment.preset("sdgp").bind(_dataset())
  norm = augment.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
  make = device_augment.batch_function(pipeline, norm)
  key = jax.random.key(11)
  got_x, got_y = make(key, RGB, LABELS)
  x, y = RGB, LABELS
  for aug, params in zip(pipeline, device_augment.draws(pipeline, key, RGB.shape)):
    x, y = aug.apply(x, y, params)
  want_x, want_y = norm.apply(x, y)
  np.testing.assert_allclose(np.asarray(got_x), want_x, rtol=0, atol=2e-6)
  np.testing.assert_array_equal(np.asarray(got_y), want_y)


def _draw_many(aug, count=400, shape=(64, 12, 10, 3)):
  keys = jax.random.split(jax.random.key(0), count)
  return jax.vmap(lambda k: device_augment.sample(aug, k, shape))(keys)


def test_flip_rate():
  flips = np.asarray(_draw_many(augment.RandomHorizontalFlip(0.25)).flipped)
  # 25 600 Bernoulli(0.25) draws: the standard error of the mean is 0.0027.
  assert abs(flips.mean() - 0.25) < 0.015


def test_offsets_cover_their_range_uniformly():
  offsets = np.asarray(_draw_many(augment.RandomCrop(4)).offsets)
  assert offsets.min() == 0 and offsets.max() == 8
  counts = np.bincount(offsets.ravel(), minlength=9) / offsets.size
  np.testing.assert_allclose(counts, 1 / 9, atol=0.01)


def test_cutout_stays_inside_the_image():
  origins = np.asarray(_draw_many(augment.Cutout(4)).origins)
  assert origins[..., 0].min() == 0 and origins[..., 0].max() == 12 - 4
  assert origins[..., 1].min() == 0 and origins[..., 1].max() == 10 - 4


def test_mixup_weight_is_beta_and_pairing_a_permutation():
  draws = _draw_many(augment.Mixup(0.3, num_classes=10), count=2000)
  lam = np.asarray(draws.lam)
  assert abs(lam.mean() - 0.5) < 0.03  # Beta(0.3, 0.3): mean 1/2, mostly near 0 or 1
  assert np.mean((lam < 0.1) | (lam > 0.9)) > 0.5
  perms = np.asarray(draws.permutation)
  assert (np.sort(perms, axis=1) == np.arange(64)).all()


def test_unsupported_augmentation_is_named():
  class Blur(augment.Augmentation):
    def apply(self, images, labels, params):
      return images, labels

  with pytest.raises(ValueError, match="augment: .*Blur.*no on-device twin"):
    device_augment.batch_function(augment.Compose([augment.RandomCrop(4), Blur()]), None)


def test_unbound_mean_fill_is_refused():
  with pytest.raises(ValueError, match="bind"):
    device_augment.apply(augment.Cutout(4, fill="mean"), RGB, LABELS, augment.CutoutParams(np.zeros((16, 2), int)))


def _dataset():
  from jaxprune import data

  return data.Dataset.from_arrays(RGB, LABELS, num_classes=10)

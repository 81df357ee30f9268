"""Tests for jaxprune.data's augmentations, against per-image reference loops fed the same
random draws."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from jaxprune import data
from jaxprune.data import augment

# ---------------------------------------------------------------------------------------------
# Augmentations: vectorised == per-image loop with the same draws
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def batch():
  rng = np.random.default_rng(42)
  return rng.integers(0, 256, (16, 10, 12, 3), dtype=np.uint8), rng.integers(0, 5, 16).astype(
    np.int32
  )


def _padded(image, padding, fill):
  h, w, c = image.shape
  out = np.empty((h + 2 * padding, w + 2 * padding, c), image.dtype)
  out[...] = np.asarray(fill, dtype=image.dtype)
  out[padding : padding + h, padding : padding + w] = image
  return out


@pytest.mark.parametrize("cls, padding, fill", [
    (augment.RandomCrop, 4, 0), (augment.RandomTranslate, 2, (7, 8, 9)), (augment.RandomCrop, 0, 0),
])  # fmt: skip
def test_crop_and_translate_match_loop(batch, cls, padding, fill):
  images, labels = batch
  aug = cls(padding, fill)
  params = aug.sample(np.random.default_rng(0), images.shape)
  assert params.offsets.min() >= 0 and params.offsets.max() <= 2 * padding
  out, out_labels = aug.apply(images, labels, params)
  h, w = images.shape[1:3]
  for i, (dy, dx) in enumerate(params.offsets):
    np.testing.assert_array_equal(
      out[i], _padded(images[i], padding, fill)[dy : dy + h, dx : dx + w]
    )
  assert out_labels is labels and out.dtype == images.dtype and out.flags.c_contiguous
  # Same generator state -> same output through __call__.
  again, _ = aug(images, labels, np.random.default_rng(0))
  np.testing.assert_array_equal(again, out)


def test_crop_offsets_cover_every_shift():
  aug = augment.RandomCrop(4)
  offsets = aug.sample(np.random.default_rng(0), (5000, 32, 32, 3)).offsets
  assert set(np.unique(offsets)) == set(range(9))


def _loader(side, augment_with):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (16, side, side, 3), dtype=np.uint8)
  dataset = data.Dataset.from_arrays(images, rng.integers(0, 4, 16), num_classes=4)
  return data.Loader(dataset, 8, augment=augment_with, prefetch=0)


def test_a_crop_padding_of_half_the_image_is_named():
  # The CIFAR preset on 8x8 images: shifts of up to 4 pixels, half the side.
  with pytest.warns(
    UserWarning,
    match=r"augment: RandomCrop\(padding=4\) shifts the 8-pixel images .* by up to 4 "
    r"pixels, half their side .* augment=\[RandomCrop\(1\), RandomHorizontalFlip\(\)\]",
  ) as caught:
    _loader(8, "clicktrain")
  assert caught[0].filename == __file__  # the line that built the loader
  with pytest.warns(UserWarning, match=r"RandomTranslate\(padding=3\) shifts the 6-pixel"):
    _loader(6, [augment.RandomTranslate(3)])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _loader(32, "clicktrain")  # what the preset is for
    _loader(8, [augment.RandomCrop(1), augment.RandomHorizontalFlip()])


def test_flip_matches_loop_and_is_an_involution(batch):
  images, labels = batch
  aug = augment.RandomHorizontalFlip()
  params = aug.sample(np.random.default_rng(3), images.shape)
  assert 0 < params.flipped.sum() < len(images)
  out, _ = aug.apply(images, labels, params)
  for i, flipped in enumerate(params.flipped):
    np.testing.assert_array_equal(out[i], images[i, :, ::-1] if flipped else images[i])
  twice, _ = aug.apply(out, labels, params)
  np.testing.assert_array_equal(twice, images)
  floats = images.astype(np.float32)
  np.testing.assert_array_equal(aug.apply(floats, labels, params)[0], out.astype(np.float32))


@pytest.mark.parametrize("fill", [0, (255, 128, 3)])
def test_cutout_matches_loop(batch, fill):
  images, labels = batch
  aug = augment.Cutout(4, fill)
  params = aug.sample(np.random.default_rng(5), images.shape)
  out, _ = aug.apply(images, labels, params)
  for i, (y, x) in enumerate(params.origins):
    assert 0 <= y <= images.shape[1] - 4 and 0 <= x <= images.shape[2] - 4
    expected = images[i].copy()
    expected[y : y + 4, x : x + 4] = fill
    np.testing.assert_array_equal(out[i], expected)
  assert not np.shares_memory(out, images)


def test_mixup_convex_combination(batch):
  images, labels = batch
  aug = augment.Mixup(0.3, num_classes=5)
  params = aug.sample(np.random.default_rng(7), images.shape)
  out, soft = aug.apply(images, labels, params)
  assert out.dtype == np.float32 and soft.shape == (16, 5) and soft.dtype == np.float32
  np.testing.assert_allclose(soft.sum(axis=1), 1.0, rtol=1e-6)
  lam = params.lam
  for i, j in enumerate(params.permutation):
    np.testing.assert_allclose(
      out[i], lam * images[i].astype(np.float64) + (1 - lam) * images[j], rtol=1e-5
    )
    expected = np.zeros(5)
    expected[labels[i]] += lam
    expected[labels[j]] += 1 - lam
    np.testing.assert_allclose(soft[i], expected, rtol=1e-6)
  with pytest.raises(ValueError, match="num_classes"):
    augment.Mixup(0.3)(images, labels, np.random.default_rng(0))


def test_normalize_matches_formula(batch):
  images, labels = batch
  mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
  out, _ = augment.Normalize(mean, std).apply(images, labels)
  expected = (images / 255.0 - np.array(mean)) / np.array(std)
  assert out.dtype == np.float32
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_presets_and_binding(batch):
  images, labels = batch
  ds = data.Dataset.from_arrays(images, labels, num_classes=5)
  assert set(augment.available_presets()) >= {"prunetrain", "clicktrain", "sdgp", "none"}
  sdgp = augment.preset("sdgp")
  with pytest.raises(ValueError, match="bind"):
    sdgp(images, labels, np.random.default_rng(0))
  bound = sdgp.bind(ds)
  mean_colour = tuple(int(m * 255) for m in ds.mean)
  assert bound.augmentations[1].fill == mean_colour and bound.augmentations[2].fill == mean_colour
  # The composition equals the members applied in order with one shared generator.
  rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
  out, _ = bound(images, labels, rng_a)
  manual = images
  for aug in bound:
    manual, _ = aug.apply(manual, labels, aug.sample(rng_b, manual.shape))
  np.testing.assert_array_equal(out, manual)
  none, _ = augment.preset("none")(images, labels, np.random.default_rng(0))
  np.testing.assert_array_equal(none, images)


def test_augmentation_bad_arguments(batch):
  images, labels = batch
  with pytest.raises(ValueError, match="padding"):
    augment.RandomCrop(-1)
  with pytest.raises(ValueError, match="size"):
    augment.Cutout(0)
  with pytest.raises(ValueError, match="exceeds the image size"):
    augment.Cutout(11)(images, labels, np.random.default_rng(0))
  with pytest.raises(ValueError, match="alpha"):
    augment.Mixup(0.0)
  with pytest.raises(ValueError, match="p must be"):
    augment.RandomHorizontalFlip(1.5)
  with pytest.raises(ValueError, match="fill"):
    augment.RandomCrop(4, fill=300)(images, labels, np.random.default_rng(0))
  with pytest.raises(ValueError, match="fill"):
    augment.Cutout(2, fill="median")
  with pytest.raises(ValueError, match="unknown augmentation preset"):
    augment.preset("autoaugment")
  with pytest.raises(ValueError, match="labels"):
    augment.RandomHorizontalFlip()(images, labels[:3], np.random.default_rng(0))

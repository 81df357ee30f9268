"""The papers' augmentations in JAX, to run inside a jitted train step on the accelerator.

Each NumPy augmentation of :mod:`jaxprune.data.augment` has a twin here: ``sample`` draws the
same kind of parameters (the same ``NamedTuple``: crop offsets, flip flags, cutout corners, the
mixup weight and pairing) from a JAX key, and ``apply`` computes exactly what the NumPy
``apply`` computes from those parameters. So a batch made on the device can be replayed on the
host from its draws (:func:`draws`), which is how the tests hold the two paths to each other.

The draws differ from the NumPy loader's (another generator), so a run on
:class:`~jaxprune.data.DeviceLoader` sees other augmented pixels than the same run on
:class:`~jaxprune.data.Loader`: equally distributed, not identical.

Example:
  >>> import jax, numpy as np
  >>> from jaxprune.data import augment, device_augment
  >>> pipeline = augment.preset("clicktrain")
  >>> make = device_augment.batch_function(pipeline, normalize=None)
  >>> images = np.zeros((8, 32, 32, 3), np.uint8)
  >>> out, labels = make(jax.random.key(0), images, np.zeros(8, np.int32))
  >>> out.shape, out.dtype
  ((8, 32, 32, 3), dtype('uint8'))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxprune.data.augment import (
  Augmentation,
  Compose,
  Cutout,
  CutoutParams,
  FlipParams,
  Mixup,
  MixupParams,
  Normalize,
  RandomCrop,
  RandomHorizontalFlip,
  RandomTranslate,
  ShiftParams,
  _fill_values,
)

__all__ = ["apply", "batch_function", "check_supported", "draws", "normalize", "sample"]

BatchFunction = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _fill(aug: Augmentation, images: jax.Array) -> jax.Array:
  # The NumPy twin's own fill check (a scalar or one value per channel, in range for uint8).
  return jnp.asarray(
    _fill_values(aug.fill, images.shape[-1], np.dtype(images.dtype), type(aug).__name__)
  )


def _shift_sample(aug: RandomCrop, key: jax.Array, shape: tuple[int, ...]) -> ShiftParams:
  return ShiftParams(jax.random.randint(key, (shape[0], 2), 0, 2 * aug.padding + 1))


def _shift_apply(aug: RandomCrop, images, labels, params: ShiftParams):
  batch, height, width, channels = images.shape
  pad = aug.padding
  padded = jnp.broadcast_to(
    _fill(aug, images), (batch, height + 2 * pad, width + 2 * pad, channels)
  )
  padded = padded.at[:, pad : pad + height, pad : pad + width].set(images)

  def window(image, origin):
    return jax.lax.dynamic_slice(image, (origin[0], origin[1], 0), (height, width, channels))

  return jax.vmap(window)(padded, params.offsets), labels


def _flip_sample(aug: RandomHorizontalFlip, key: jax.Array, shape: tuple[int, ...]) -> FlipParams:
  return FlipParams(jax.random.uniform(key, (shape[0],)) < aug.p)


def _flip_apply(aug: RandomHorizontalFlip, images, labels, params: FlipParams):
  return jnp.where(params.flipped[:, None, None, None], images[:, :, ::-1], images), labels


def _cutout_sample(aug: Cutout, key: jax.Array, shape: tuple[int, ...]) -> CutoutParams:
  batch, height, width = shape[:3]
  if aug.size > min(height, width):
    raise ValueError(f"Cutout size {aug.size} exceeds the image size {height}x{width}")
  rows_key, cols_key = jax.random.split(key)
  rows = jax.random.randint(rows_key, (batch,), 0, height - aug.size + 1)
  cols = jax.random.randint(cols_key, (batch,), 0, width - aug.size + 1)
  return CutoutParams(jnp.stack([rows, cols], axis=1))


def _cutout_apply(aug: Cutout, images, labels, params: CutoutParams):
  _, height, width, _ = images.shape
  rows = jnp.arange(height)[None, :, None]
  cols = jnp.arange(width)[None, None, :]
  top, left = params.origins[:, 0, None, None], params.origins[:, 1, None, None]
  inside = (rows >= top) & (rows < top + aug.size) & (cols >= left) & (cols < left + aug.size)
  return jnp.where(inside[..., None], _fill(aug, images), images), labels


def _mixup_sample(aug: Mixup, key: jax.Array, shape: tuple[int, ...]) -> MixupParams:
  lam_key, perm_key = jax.random.split(key)
  return MixupParams(
    jax.random.beta(lam_key, aug.alpha, aug.alpha).astype(jnp.float32),
    jax.random.permutation(perm_key, shape[0]),
  )


def _mixup_apply(aug: Mixup, images, labels, params: MixupParams):
  if labels.ndim == 2:
    soft = labels.astype(jnp.float32)
  elif aug.num_classes is None:
    raise ValueError("Mixup needs num_classes for integer labels (or .bind(dataset))")
  else:
    soft = jax.nn.one_hot(labels, aug.num_classes, dtype=jnp.float32)
  lam = jnp.asarray(params.lam, jnp.float32)
  perm = params.permutation
  # The same two products and sum as the NumPy twin (float32 throughout).
  mixed_x = images.astype(jnp.float32) * lam + images[perm].astype(jnp.float32) * (1 - lam)
  mixed_y = lam * soft + (1 - lam) * soft[perm]
  return mixed_x, mixed_y


# Exact classes: a user's subclass may change what its NumPy twin computes.
_TWINS: dict[type, tuple[Callable, Callable]] = {
  RandomCrop: (_shift_sample, _shift_apply),
  RandomTranslate: (_shift_sample, _shift_apply),
  RandomHorizontalFlip: (_flip_sample, _flip_apply),
  Cutout: (_cutout_sample, _cutout_apply),
  Mixup: (_mixup_sample, _mixup_apply),
}


def _twin(aug: Augmentation) -> tuple[Callable, Callable]:
  twin = _TWINS.get(type(aug))
  if twin is not None:
    return twin
  raise ValueError(
    f"augment: {aug!r} has no on-device twin (supported: RandomCrop, RandomTranslate, "
    "RandomHorizontalFlip, Cutout, Mixup); use jaxprune.data.Loader for it"
  )


def check_supported(pipeline: Compose) -> None:
  """Raises ``ValueError`` naming the first augmentation of ``pipeline`` with no device twin."""
  for aug in pipeline:
    _twin(aug)


def sample(aug: Augmentation, key: jax.Array, batch_shape: tuple[int, ...]) -> Any:
  """``aug``'s draws for a batch of ``batch_shape`` (NHWC), drawn from ``key``.

  As its NumPy ``sample`` returns them.
  """
  return _twin(aug)[0](aug, key, tuple(batch_shape))


def apply(aug: Augmentation, images: jax.Array, labels: jax.Array, params: Any):
  """``aug`` applied with the draws ``params``: what ``aug.apply`` computes in NumPy."""
  return _twin(aug)[1](aug, images, labels, params)


def normalize(norm: Normalize, images: jax.Array) -> jax.Array:
  """:class:`~jaxprune.data.augment.Normalize` in JAX.

  ``x·scale + shift`` in float32 with the twin's own per-channel constants.
  """
  if images.shape[-1] != norm._scale.size:
    raise ValueError(f"Normalize has {norm._scale.size} channels, images have {images.shape[-1]}")
  return images.astype(jnp.float32) * jnp.asarray(norm._scale) + jnp.asarray(norm._shift)


_normalize = normalize  # batch_function's argument of the same name shadows it


def _member_keys(key: jax.Array, count: int) -> list[jax.Array]:
  return [jax.random.fold_in(key, i) for i in range(count)]


def draws(pipeline: Compose, key: jax.Array, batch_shape: tuple[int, ...]) -> list[Any]:
  """The draws :func:`batch_function` makes from ``key``, as NumPy values.

  One per member of ``pipeline`` (to replay the same batch through the NumPy augmentations).
  """
  out = []
  for aug, member_key in zip(pipeline, _member_keys(key, len(pipeline))):
    params = sample(aug, member_key, batch_shape)
    out.append(type(params)(*(np.asarray(v) for v in params)))
  return out


def batch_function(pipeline: Compose, normalize: Normalize | None) -> BatchFunction:
  """``fn(key, images, labels) -> (images, labels)``: ``pipeline`` then ``normalize``, in JAX.

  Member ``i`` of the pipeline draws from ``fold_in(key, i)``. The function is pure and
  traceable, so a train step can make its own batch from a device-resident data set.

  Args:
    pipeline: a bound :class:`~jaxprune.data.augment.Compose` (``pipeline.bind(dataset)``).
    normalize: the final normalisation, or ``None`` for none.

  Returns:
    The batch function.

  Raises:
    ValueError: a member of ``pipeline`` has no device twin (named).
  """
  check_supported(pipeline)
  members = tuple(pipeline)

  def make(key: jax.Array, images: jax.Array, labels: jax.Array):
    for aug, member_key in zip(members, _member_keys(key, len(members))):
      images, labels = apply(aug, images, labels, sample(aug, member_key, images.shape))
    if normalize is not None:
      images = _normalize(normalize, images)
    return images, labels

  return make

"""Batched, seeded data augmentation in NumPy (no per-image Python loops).

Every augmentation maps a batch ``(images, labels)`` to a new batch, with all randomness drawn
from a ``np.random.Generator`` in :meth:`Augmentation.sample` and applied, vectorised over the
batch, in :meth:`Augmentation.apply` — so the same draws can be replayed against a reference.
Images are NHWC, uint8 (pixel units) or float; labels are int [B] or soft float [B, C].

Presets follow the papers' recipes:

* ``"prunetrain"`` / ``"clicktrain"``: 4-pixel zero-padded random crop + horizontal flip
  (He et al.'s CIFAR recipe, used by both PruneTrain and ClickTrain).
* ``"clicktrain-mixup"``: the same, then mixup with alpha 0.3 (ClickTrain after the hard prune).
* ``"sdgp"``: flip, random translate by up to 2 pixels, 4x4 cutout, both filled with the mean
  colour (the ffcv CIFAR recipe SDGP trains with).
* ``"none"``: identity.

Example:
  >>> import numpy as np
  >>> from jaxprune.data import augment
  >>> crop_flip = augment.Compose([augment.RandomCrop(4), augment.RandomHorizontalFlip()])
  >>> images = np.zeros((8, 32, 32, 3), np.uint8)
  >>> out, labels = crop_flip(images, np.zeros(8, np.int32), np.random.default_rng(0))
  >>> out.shape
  (8, 32, 32, 3)
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
  from jaxprune.data.dataset import Dataset

__all__ = [
  "Augmentation",
  "Compose",
  "Cutout",
  "Mixup",
  "Normalize",
  "RandomCrop",
  "RandomHorizontalFlip",
  "RandomTranslate",
  "as_augmentation",
  "available_presets",
  "preset",
]

Fill = float | Sequence[float] | str


class Augmentation:
  """A batched random transform of ``(images, labels)``.

  Subclasses implement :meth:`sample` (all random draws for a batch) and :meth:`apply`
  (deterministic, vectorised); :meth:`bind` fills in defaults that depend on the data set.
  """

  def sample(self, rng: np.random.Generator, batch_shape: tuple[int, ...]) -> Any:
    """The random draws for a batch of images of shape ``batch_shape`` (NHWC)."""
    return None

  def apply(
    self, images: np.ndarray, labels: np.ndarray, params: Any
  ) -> tuple[np.ndarray, np.ndarray]:
    """Applies the transform with the given draws; never modifies its inputs."""
    raise NotImplementedError

  def bind(self, dataset: Dataset) -> Augmentation:
    """A copy with data-set dependent settings (mean fill colour, class count) resolved."""
    return self

  def __call__(
    self, images: np.ndarray, labels: np.ndarray, rng: np.random.Generator
  ) -> tuple[np.ndarray, np.ndarray]:
    _check_batch(images, labels)
    return self.apply(images, labels, self.sample(rng, images.shape))


def _check_batch(images: np.ndarray, labels: np.ndarray) -> None:
  if not isinstance(images, np.ndarray) or images.ndim != 4:
    raise ValueError(
      f"images must be an NHWC numpy array, got shape {getattr(images, 'shape', None)}"
    )
  labels = np.asarray(labels)
  if labels.ndim not in (1, 2) or labels.shape[0] != images.shape[0]:
    raise ValueError(
      f"labels must be [B] or [B, C] with B={images.shape[0]}, got shape {labels.shape}"
    )


def _fill_values(fill: Fill, channels: int, dtype: np.dtype, owner: str) -> np.ndarray:
  if isinstance(fill, str):
    raise ValueError(
      f"{owner}: fill={fill!r} must be resolved first with .bind(dataset) (a Loader does this), "
      "or given as numbers"
    )
  values = np.asarray(fill, dtype=np.float64)
  if values.ndim > 1 or (values.ndim == 1 and values.shape[0] not in (1, channels)):
    raise ValueError(
      f"{owner}: fill must be a scalar or one value per channel ({channels}), got {fill!r}"
    )
  values = np.broadcast_to(values, (channels,))
  if np.dtype(dtype) == np.uint8 and (values.min() < 0 or values.max() > 255):
    raise ValueError(f"{owner}: fill {fill!r} is outside 0..255 for uint8 images")
  return values.astype(dtype)


def _mean_colour(dataset: Dataset) -> tuple[int, ...]:
  # Pixel units, truncated like ffcv's tuple(map(int, CIFAR_MEAN)) in the SDGP recipe.
  return tuple(int(m * 255) for m in dataset.mean)


def _check_fill_spec(fill: Fill, owner: str) -> None:
  if isinstance(fill, str) and fill != "mean":
    raise ValueError(f"{owner}: fill must be numbers or 'mean', got {fill!r}")


class ShiftParams(NamedTuple):
  offsets: np.ndarray  # (B, 2) int: window origin (row, col) in the padded image, in [0, 2*padding]


def _warn_large_shift(crop: RandomCrop, dataset: Dataset) -> None:
  """Warns when ``crop`` may shift the data set's images by half their side or more.

  The papers' presets pad 32x32 CIFAR images by 4 pixels (an eighth of the side); on small
  images (8x8 digits) the same padding leaves half of a view empty and training fails to
  learn without a word.
  """
  side = min(np.shape(dataset.images)[1:3])
  if 2 * crop.padding < side:
    return
  warnings.warn(
    f"augment: {type(crop).__name__}(padding={crop.padding}) shifts the {side}-pixel images "
    f"of this data set by up to {crop.padding} pixels, half their side or more, so much of "
    "each view is padding (the papers' presets are sized for 32x32 CIFAR); use a smaller "
    f"padding, e.g. augment=[RandomCrop({max(1, side // 8)}), RandomHorizontalFlip()], or "
    "augment=None",
    UserWarning,
    stacklevel=_outside_this_package(),
  )


def _outside_this_package() -> int:
  """The ``stacklevel`` of the first caller outside ``jaxprune.data`` (the line that built
  the loader, however many frames binding took)."""
  here = os.path.dirname(__file__)
  frame, level = sys._getframe(1), 1
  while frame is not None and os.path.dirname(frame.f_code.co_filename) == here:
    frame, level = frame.f_back, level + 1
  return level


class RandomCrop(Augmentation):
  """Pads by ``padding`` pixels, then takes a random window of the original size.

  Pads on every side with ``fill`` (torchvision ``RandomCrop(H, padding)``; the CIFAR recipe of He
  et al.).

  Args:
    padding: pixels added on each side (>= 0); offsets are uniform in ``[0, 2*padding]``.
    fill: padding value: scalar, one per channel (pixel units), or ``"mean"`` (bound to the
      data set's mean colour).
  """

  def __init__(self, padding: int = 4, fill: Fill = 0):
    if not isinstance(padding, (int, np.integer)) or padding < 0:
      raise ValueError(f"padding must be a non-negative int, got {padding!r}")
    _check_fill_spec(fill, type(self).__name__)
    self.padding = int(padding)
    self.fill = fill

  def __repr__(self) -> str:
    return f"{type(self).__name__}(padding={self.padding}, fill={self.fill!r})"

  def bind(self, dataset: Dataset) -> Augmentation:
    _warn_large_shift(self, dataset)
    if self.fill == "mean":
      return type(self)(self.padding, _mean_colour(dataset))
    return self

  def sample(self, rng: np.random.Generator, batch_shape: tuple[int, ...]) -> ShiftParams:
    return ShiftParams(rng.integers(0, 2 * self.padding + 1, size=(batch_shape[0], 2)))

  def apply(
    self, images: np.ndarray, labels: np.ndarray, params: ShiftParams
  ) -> tuple[np.ndarray, np.ndarray]:
    batch, height, width, channels = images.shape
    pad = self.padding
    fill = _fill_values(self.fill, channels, images.dtype, type(self).__name__)
    # One filled padded image, broadcast over the batch: copying whole rows is far faster than
    # assigning a length-C fill vector pixel by pixel.
    template = np.empty((height + 2 * pad, width + 2 * pad, channels), images.dtype)
    template[...] = fill
    padded = np.empty((batch, *template.shape), images.dtype)
    padded[...] = template
    padded[:, pad : pad + height, pad : pad + width] = images
    # Rows as flat (W*C) runs; every (H, W*C) window as a strided view, no copy:
    # (B, 2p+1, 2p*C+1, H, W*C). One gather picks each image's window (column offset x*C).
    flat = padded.reshape(batch, height + 2 * pad, (width + 2 * pad) * channels)
    windows = np.lib.stride_tricks.sliding_window_view(
      flat, (height, width * channels), axis=(1, 2)
    )
    picked = windows[np.arange(batch), params.offsets[:, 0], params.offsets[:, 1] * channels]
    return picked.reshape(images.shape), labels


class RandomTranslate(RandomCrop):
  """ffcv's ``RandomTranslate(padding, fill)``: shift by up to ``padding`` pixels each way.

  The same operation as :class:`RandomCrop` (pad with ``fill``, take a random same-size
  window); the SDGP recipe uses ``padding=2`` with the mean colour as fill.
  """

  def __init__(self, padding: int = 2, fill: Fill = 0):
    super().__init__(padding, fill)


class FlipParams(NamedTuple):
  flipped: np.ndarray  # (B,) bool


class RandomHorizontalFlip(Augmentation):
  """Mirrors each image left-right with probability ``p``."""

  def __init__(self, p: float = 0.5):
    if not 0.0 <= p <= 1.0:
      raise ValueError(f"p must be in [0, 1], got {p!r}")
    self.p = float(p)

  def __repr__(self) -> str:
    return f"RandomHorizontalFlip(p={self.p})"

  def sample(self, rng: np.random.Generator, batch_shape: tuple[int, ...]) -> FlipParams:
    return FlipParams(rng.random(batch_shape[0]) < self.p)

  def apply(
    self, images: np.ndarray, labels: np.ndarray, params: FlipParams
  ) -> tuple[np.ndarray, np.ndarray]:
    images = np.ascontiguousarray(images)
    batch, height, width, channels = images.shape
    # View each pixel (all its channels) as one opaque element: reversing along W then moves
    # C values per index instead of one, several times faster than an NHWC fancy index.
    pixel = np.dtype((np.void, channels * images.itemsize))
    pixels = images.view(pixel).reshape(batch, height, width)
    out = pixels.copy()
    rows = np.flatnonzero(params.flipped)
    out[rows] = pixels[rows, :, ::-1]
    return out.view(images.dtype).reshape(images.shape), labels


class CutoutParams(NamedTuple):
  origins: np.ndarray  # (B, 2) int: top-left corner (row, col) of the square


class Cutout(Augmentation):
  """Fills one ``size`` x ``size`` square per image with ``fill`` (DeVries & Taylor 2017).

  As in ffcv's ``Cutout`` (the SDGP recipe), the square lies wholly inside the image: its
  top-left corner is uniform over ``[0, H - size] x [0, W - size]``.

  Args:
    size: side of the square (>= 1, at most the image side).
    fill: scalar, one value per channel (pixel units), or ``"mean"``.
  """

  def __init__(self, size: int, fill: Fill = 0):
    if not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(f"size must be a positive int, got {size!r}")
    _check_fill_spec(fill, "Cutout")
    self.size = int(size)
    self.fill = fill

  def __repr__(self) -> str:
    return f"Cutout(size={self.size}, fill={self.fill!r})"

  def bind(self, dataset: Dataset) -> Augmentation:
    return Cutout(self.size, _mean_colour(dataset)) if self.fill == "mean" else self

  def sample(self, rng: np.random.Generator, batch_shape: tuple[int, ...]) -> CutoutParams:
    batch, height, width = batch_shape[:3]
    if self.size > min(height, width):
      raise ValueError(f"Cutout size {self.size} exceeds the image size {height}x{width}")
    rows = rng.integers(0, height - self.size + 1, size=batch)
    cols = rng.integers(0, width - self.size + 1, size=batch)
    return CutoutParams(np.stack([rows, cols], axis=1))

  def apply(
    self, images: np.ndarray, labels: np.ndarray, params: CutoutParams
  ) -> tuple[np.ndarray, np.ndarray]:
    fill = _fill_values(self.fill, images.shape[-1], images.dtype, "Cutout")
    out = images.copy()
    span = np.arange(self.size)
    rows = (params.origins[:, 0:1] + span)[:, :, None]  # (B, s, 1)
    cols = (params.origins[:, 1:2] + span)[:, None, :]  # (B, 1, s)
    out[np.arange(out.shape[0])[:, None, None], rows, cols] = fill
    return out, labels


class MixupParams(NamedTuple):
  lam: float  # weight of the batch itself
  permutation: np.ndarray  # (B,) partner of each example


class Mixup(Augmentation):
  """mixup (Zhang et al., ICLR'18): ``x = lam*x + (1-lam)*x[perm]``, same for one-hot labels.

  One ``lam ~ Beta(alpha, alpha)`` per batch and a random pairing, as in the reference
  implementation ClickTrain uses after its hard prune (alpha 0.3). Returns float32 images
  (same units as the input) and float32 soft labels [B, num_classes].

  Args:
    alpha: Beta distribution parameter (> 0).
    num_classes: for one-hot encoding integer labels; ``None`` takes the bound data set's.
  """

  def __init__(self, alpha: float, num_classes: int | None = None):
    if not alpha > 0:
      raise ValueError(f"alpha must be positive, got {alpha!r}")
    if num_classes is not None and (
      not isinstance(num_classes, (int, np.integer)) or num_classes < 1
    ):
      raise ValueError(f"num_classes must be a positive int or None, got {num_classes!r}")
    self.alpha = float(alpha)
    self.num_classes = num_classes

  def __repr__(self) -> str:
    return f"Mixup(alpha={self.alpha}, num_classes={self.num_classes})"

  def bind(self, dataset: Dataset) -> Augmentation:
    return Mixup(self.alpha, dataset.num_classes) if self.num_classes is None else self

  def sample(self, rng: np.random.Generator, batch_shape: tuple[int, ...]) -> MixupParams:
    return MixupParams(float(rng.beta(self.alpha, self.alpha)), rng.permutation(batch_shape[0]))

  def _soft_labels(self, labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim == 2:
      return labels.astype(np.float32)
    if self.num_classes is None:
      raise ValueError("Mixup needs num_classes for integer labels (or .bind(dataset))")
    if labels.min() < 0 or labels.max() >= self.num_classes:
      raise ValueError(f"labels must lie in [0, {self.num_classes}) for Mixup")
    return np.eye(self.num_classes, dtype=np.float32)[labels]

  def apply(
    self, images: np.ndarray, labels: np.ndarray, params: MixupParams
  ) -> tuple[np.ndarray, np.ndarray]:
    lam, perm = np.float32(params.lam), params.permutation
    y = self._soft_labels(labels)
    # Partners gathered in the input dtype (uint8: 4x less to move), converted while scaling.
    mixed_x = np.multiply(images, lam, dtype=np.float32)
    mixed_x += np.multiply(images[perm], 1 - lam, dtype=np.float32)
    mixed_y = lam * y
    mixed_y += (1 - lam) * y[perm]
    return mixed_x, mixed_y


class Normalize(Augmentation):
  """``(images / 255 - mean) / std`` as float32; mean and std per channel in [0, 1] units.

  Deterministic. Accepts uint8 or float images in pixel units (e.g. after :class:`Mixup`,
  which commutes with this affine map).
  """

  def __init__(self, mean: Sequence[float], std: Sequence[float]):
    mean_array = np.asarray(mean, dtype=np.float64).reshape(-1)
    std_array = np.asarray(std, dtype=np.float64).reshape(-1)
    if mean_array.shape != std_array.shape or mean_array.size == 0:
      raise ValueError(f"mean and std must have one entry per channel, got {mean!r} and {std!r}")
    if (std_array <= 0).any():
      raise ValueError(f"std must be positive, got {std!r}")
    self.mean = tuple(float(m) for m in mean_array)
    self.std = tuple(float(s) for s in std_array)
    self._scale = (1.0 / (255.0 * std_array)).astype(np.float32)
    self._shift = (-mean_array / std_array).astype(np.float32)
    self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def __repr__(self) -> str:
    return f"Normalize(mean={self.mean}, std={self.std})"

  def apply(
    self, images: np.ndarray, labels: np.ndarray, params: Any = None
  ) -> tuple[np.ndarray, np.ndarray]:
    channels = images.shape[-1]
    if channels != self._scale.size:
      raise ValueError(f"Normalize has {self._scale.size} channels, images have {channels}")
    per_image = int(np.prod(images.shape[1:]))
    if per_image not in self._rows:
      # Whole-image-long scale/shift rows: broadcasting a length-C vector over NHWC makes
      # NumPy run an inner loop of length C (3), about 8x slower.
      repeats = per_image // channels
      self._rows[per_image] = (np.tile(self._scale, repeats), np.tile(self._shift, repeats))
    scale, shift = self._rows[per_image]
    out = images.reshape(images.shape[0], per_image).astype(np.float32)
    out *= scale
    out += shift
    return out.reshape(images.shape), labels


class Compose(Augmentation):
  """Applies augmentations in order, all drawing from the same generator."""

  def __init__(self, augmentations: Sequence[Augmentation] = ()):
    augmentations = tuple(augmentations)
    for aug in augmentations:
      if not isinstance(aug, Augmentation):
        raise ValueError(f"Compose takes Augmentation instances, got {aug!r}")
    self.augmentations = augmentations

  def __repr__(self) -> str:
    return f"Compose({list(self.augmentations)!r})"

  def __iter__(self):
    return iter(self.augmentations)

  def __len__(self) -> int:
    return len(self.augmentations)

  def bind(self, dataset: Dataset) -> Compose:
    return Compose([aug.bind(dataset) for aug in self.augmentations])

  def __call__(
    self, images: np.ndarray, labels: np.ndarray, rng: np.random.Generator
  ) -> tuple[np.ndarray, np.ndarray]:
    _check_batch(images, labels)
    for aug in self.augmentations:
      images, labels = aug.apply(images, labels, aug.sample(rng, images.shape))
    return images, labels

  def apply(
    self, images: np.ndarray, labels: np.ndarray, params: Any
  ) -> tuple[np.ndarray, np.ndarray]:
    raise TypeError("Compose draws per member; call it with a generator instead")


def _presets() -> dict[str, Compose]:
  crop_flip = [RandomCrop(4), RandomHorizontalFlip()]
  return {
    "none": Compose([]),
    "prunetrain": Compose(crop_flip),
    "clicktrain": Compose(crop_flip),
    "clicktrain-mixup": Compose([*crop_flip, Mixup(0.3)]),
    "sdgp": Compose(
      [RandomHorizontalFlip(), RandomTranslate(2, fill="mean"), Cutout(4, fill="mean")]
    ),
  }


def available_presets() -> tuple[str, ...]:
  """Names accepted by :func:`preset`."""
  return tuple(_presets())


def preset(name: str) -> Compose:
  """A named augmentation recipe (unbound: a Loader binds it to its data set).

  Raises:
    ValueError: unknown ``name``.
  """
  presets = _presets()
  if name not in presets:
    raise ValueError(f"unknown augmentation preset {name!r}; available: {', '.join(presets)}")
  return presets[name]


def as_augmentation(augment: None | str | Augmentation | Sequence[Augmentation]) -> Compose:
  """Normalises the ways of naming a pipeline (None, preset name, one, or a list) to a Compose."""
  if augment is None:
    return Compose([])
  if isinstance(augment, str):
    return preset(augment)
  if isinstance(augment, Compose):
    return augment
  if isinstance(augment, Augmentation):
    return Compose([augment])
  if isinstance(augment, Sequence):
    return Compose(augment)
  raise ValueError(
    f"augment must be None, a preset name, an Augmentation or a list of them, got {augment!r}"
  )

"""ImageNet from its standard folder layout, decoded by worker processes (``grain``).

Needs the ``imagenet`` extra (``pip install 'jaxprune[imagenet]'``: grain); import it as
``jaxprune.data.imagenet`` or open it by name with :func:`jaxprune.data.open_stream`.

The layout is ``<root>/train/<wnid>/*.JPEG`` and ``<root>/val/<wnid>/*.JPEG`` (the validation
set sorted into class folders). Class ``i`` is the ``i``-th training folder name in sorted order;
files are listed sorted, so the record order is a pure function of the folder.

Training images get the standard recipe (torchvision's, and ffcv's in SDGP's code): a random
resized crop (area 8–100 % of the image, aspect ratio 3/4–4/3, ten tries then a centre crop)
resized to ``image_size``, then a horizontal flip with probability 1/2. Evaluation resizes the
shorter side to ``image_size / crop_ratio`` (256 for 224) and takes the centre
``image_size`` square. Both finish with ``(x / 255 - mean) / std`` (ImageNet statistics).

Why ``grain``, and which of it: its ``DataLoader`` runs the JPEG decoding and augmentation in
worker processes (JPEG decoding holds the GIL, so threads do not scale), which is what we need
from it. Its ``IndexSampler`` sharding is not used: in grain 0.2.18 a record
count not divisible by the number of shards loses records (10 records over 3 shards yield 9),
so an epoch would not cover the data. The order, the shards, the batches and every record's
random draws are made here instead, from ``(seed, epoch)``: grain's records are whole batches
(one transfer per batch; per-image transfers cost more than decoding), and each image carries
its own seed, so a batch does not depend on the number of workers, and resuming at a step
reproduces the rest of the epoch.

Example:
  >>> from jaxprune.data.imagenet import ImageNetLoader
  >>> train = ImageNetLoader("/data/imagenet", "train", batch_size=256, num_workers=8,
  ...                             process_index=jax.process_index(),
  ...                             process_count=jax.process_count())
  >>> for images, labels in train:  # one epoch of this process's shard
  ...     pass
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from jaxprune.data._spawn import GUARD_ADVICE, unguarded_main_script

try:
  import cloudpickle
  import grain
  from absl import flags
except ImportError as error:  # the optional extra is missing: say which one
  raise ImportError(
    f"jaxprune.data.imagenet needs grain ({error}): pip install 'jaxprune[imagenet]'"
  ) from error

__all__ = [
  "IMAGENET_MEAN",
  "IMAGENET_STD",
  "ImageFolder",
  "ImageNetLoader",
  "center_crop",
  "random_resized_crop",
  "random_resized_crop_box",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_EXTENSIONS = (".jpeg", ".jpg", ".png")
_SPLITS = ("train", "val")


@dataclasses.dataclass(frozen=True, eq=False)
class ImageFolder:
  """The files and labels of one split of a class-folder data set.

  Attributes:
    root: the data set folder (holding ``train/`` and ``val/``).
    split: ``"train"`` or ``"val"``.
    paths: every image file of the split, class by class, each class's files sorted.
    labels: int32 label of each path.
    class_names: the sorted class folder names of ``train/`` (label ``i`` is the ``i``-th).
  """

  root: Path
  split: str
  paths: tuple[str, ...]
  labels: np.ndarray
  class_names: tuple[str, ...]

  @classmethod
  def scan(cls, root: str | os.PathLike, split: str = "train") -> ImageFolder:
    """Lists ``root/<split>/<class>/*`` (``.JPEG``, ``.jpg``, ``.png``, any case).

    Raises:
      ValueError: unknown ``split``, no class folders, an empty class, or a ``val`` class
        that has no ``train`` folder.
      FileNotFoundError: ``root/<split>`` (or ``root/train``, which names the classes) is
        missing.
    """
    if split not in _SPLITS:
      raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    root = Path(root).expanduser()
    classes = _class_folders(root / "train")
    index = {name: i for i, name in enumerate(classes)}
    paths, labels = [], []
    for name in _class_folders(root / split):
      if name not in index:
        raise ValueError(f"root: {split}/{name} is not a class of {root / 'train'}")
      files = sorted(
        e.name for e in os.scandir(root / split / name)
        if e.is_file() and e.name.lower().endswith(_EXTENSIONS)
      )  # fmt: skip
      if not files:
        raise ValueError(f"root: class folder {root / split / name} holds no images")
      paths.extend(str(root / split / name / f) for f in files)
      labels.extend([index[name]] * len(files))
    return cls(root, split, tuple(paths), np.asarray(labels, np.int32), classes)

  def __len__(self) -> int:
    return len(self.paths)

  @property
  def num_classes(self) -> int:
    return len(self.class_names)


def _class_folders(folder: Path) -> tuple[str, ...]:
  if not folder.is_dir():
    raise FileNotFoundError(f"root: {folder} is not a folder")
  names = tuple(sorted(e.name for e in os.scandir(folder) if e.is_dir()))
  if not names:
    raise ValueError(f"root: {folder} holds no class folders")
  return names


# ---------------------------------------------------------------------------------------------
# Transforms (PIL in, uint8 HWC out); the random ones draw from a numpy Generator.
# ---------------------------------------------------------------------------------------------


def random_resized_crop_box(
  height: int,
  width: int,
  rng: np.random.Generator,
  scale: tuple[float, float] = (0.08, 1.0),
  ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
  """``(top, left, h, w)`` of a random crop (torchvision's ``RandomResizedCrop``).

  Area a uniform fraction in ``scale`` of the image, aspect ratio ``w / h`` log-uniform in
  ``ratio``; ten tries, then the largest centred crop whose ratio is clamped into ``ratio``.
  """
  area = height * width
  log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
  for _ in range(10):
    target = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(log_lo, log_hi))
    w = round(math.sqrt(target * aspect))
    h = round(math.sqrt(target / aspect))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return top, left, h, w
  in_ratio = width / height
  if in_ratio < min(ratio):
    w, h = width, round(width / min(ratio))
  elif in_ratio > max(ratio):
    w, h = round(height * max(ratio)), height
  else:
    w, h = width, height
  return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop(
  image: Image.Image, size: int, rng: np.random.Generator, *, flip: bool = True
) -> np.ndarray:
  """Training view: a random resized crop, then an optional flip.

  :func:`random_resized_crop_box`, bilinear resize to ``size`` x ``size``, then (``flip``) a
  horizontal flip with probability 1/2. Returns uint8 ``(size, size, 3)``.
  """
  top, left, h, w = random_resized_crop_box(image.height, image.width, rng)
  out = image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
  array = np.asarray(out, np.uint8)
  if flip and rng.random() < 0.5:
    array = array[:, ::-1]
  return np.ascontiguousarray(array)


def center_crop(image: Image.Image, size: int, crop_ratio: float = 0.875) -> np.ndarray:
  """Evaluation view: a resize of the shorter side, then the centre square.

  Bilinear resize of the shorter side to ``round(size / crop_ratio)``, then the centre ``size`` x
  ``size`` square. Returns uint8 ``(size, size, 3)``.
  """
  resize = round(size / crop_ratio)
  scale = resize / min(image.width, image.height)
  w = resize if image.width <= image.height else round(image.width * scale)
  h = resize if image.height <= image.width else round(image.height * scale)
  array = np.asarray(image.resize((w, h), Image.BILINEAR), np.uint8)
  top, left = round((h - size) / 2), round((w - size) / 2)
  return np.ascontiguousarray(array[top : top + size, left : left + size])


def _decode(path: str) -> Image.Image:
  with Image.open(path) as image:
    return image.convert("RGB")


class _DecodeBatch(grain.transforms.Map):
  """A worker's work: decode and crop every record of one batch (random crops from each
  record's own seed), stacked. Whole batches cross the process boundary: per-image transfers
  cost more than the decoding."""

  def __init__(self, train: bool, size: int, crop_ratio: float):
    self.train, self.size, self.crop_ratio = train, size, crop_ratio

  def map(self, batch: tuple[list[str], np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    paths, labels, seeds = batch
    views = []
    for path, seed in zip(paths, seeds):
      image = _decode(path)
      if self.train:
        views.append(random_resized_crop(image, self.size, np.random.default_rng(int(seed))))
      else:
        views.append(center_crop(image, self.size, self.crop_ratio))
    return np.stack(views), labels


@dataclasses.dataclass(frozen=True)
class _Batches:
  """A grain random-access source whose element ``i`` is batch ``i`` (paths, labels, seeds)
  of one process's epoch: batch composition is fixed here, whatever the number of workers."""

  paths: tuple[str, ...]
  labels: np.ndarray
  order: np.ndarray  # record indices of this process's shard, in epoch order
  seeds: np.ndarray  # one augmentation seed per entry of ``order``
  batch_size: int

  def __len__(self) -> int:
    return -(-len(self.order) // self.batch_size)

  def __getitem__(self, i: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    rows = self.order[i * self.batch_size : (i + 1) * self.batch_size]
    seeds = self.seeds[i * self.batch_size : (i + 1) * self.batch_size]
    return [self.paths[j] for j in rows], self.labels[rows], seeds


# ---------------------------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------------------------


def _check_int(value: object, name: str, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
  return int(value)


def _explain_worker_death(loader: Iterable, num_workers: int) -> Iterator:
  """``loader``'s items (in batch order: grain reads its workers round-robin); grain's bare
  "Worker process was terminated" becomes an error that says what to check and do."""
  try:
    yield from loader
  except RuntimeError as error:
    if not num_workers or "terminated" not in str(error):
      raise
    raise RuntimeError(
      f"a worker process of ImageNetLoader(num_workers={num_workers}) died; its traceback is "
      "printed above this one. If it ends in 'An attempt has been made to start a new process "
      "before the current process has finished its bootstrapping phase', the worker re-ran "
      f"the main script and reached the loader again: {GUARD_ADVICE}. Otherwise (out of "
      "memory, a crash while decoding), num_workers=0 shows the error in this process."
    ) from error


class ImageNetLoader:
  """Batches of one split of an ImageNet-layout folder, for one process of a data-parallel run.

  Epoch ``e`` orders the split by a permutation seeded by ``(seed, e)`` (data set order when
  ``shuffle`` is off) and deals it out round-robin: process ``p`` of ``P`` gets positions
  ``p, p + P, ...``, so the shards are disjoint and together cover every image once. With
  ``drop_last`` (the training default) every shard is cut to ``N // P`` images and then to whole
  batches, so all processes run the same number of steps; without it every image is served
  once, and the last batch of a shard may be short. Each record's augmentation seed comes from
  ``(seed, e, position)``, so a batch is a pure function of ``(seed, epoch, step)`` and of
  ``process_index`` / ``process_count``, whatever ``num_workers``.

  Iterating runs the current epoch from the current step and then advances :attr:`epoch`;
  :meth:`state` / :meth:`restore` resume mid-epoch (``{"epoch", "step"}``).

  Args:
    root: the data set folder (``train/<wnid>/*.JPEG``, ``val/<wnid>/*.JPEG``).
    split: ``"train"`` (random resized crop + flip) or ``"val"`` (resize + centre crop).
    batch_size: images per batch on this process.
    image_size: side of the square output.
    crop_ratio: evaluation crop / resize ratio (0.875: 224 of 256).
    seed: non-negative int.
    shuffle, drop_last: default ``True`` for ``"train"``, ``False`` for ``"val"``.
    process_index, process_count: this process and the number of processes
      (``jax.process_index()``, ``jax.process_count()`` in a multi-host run).
    num_workers: decoding processes (0: decode in this process). Each is spawned anew every
      epoch and imports grain, and JAX with it (seconds), and each batch is copied once between
      processes: they pay where cores are free (on a busy 2-core machine 0 was fastest, see
      ``experiments/results/benchmarks/imagenet_loader_throughput.md``). Workers are
      spawned and re-run the main script first, so a script must build and iterate the
      loader under ``if __name__ == "__main__":``; one without that guard is refused before
      any worker starts.
    prefetch: batches each worker keeps ready.
    mean, std: per-channel normalisation in [0, 1] units (ImageNet's by default).

  Yields:
    ``(images, labels)``: float32 ``(B, image_size, image_size, 3)``, int32 ``(B,)``.

  Raises:
    ValueError: a bad argument (named); see :meth:`ImageFolder.scan` for the folder.
    RuntimeError: when iterated with ``num_workers``: the main script has no
      ``__main__`` guard, or a worker died (the error says what to check and do).
  """

  def __init__(
    self,
    root: str | os.PathLike | ImageFolder,
    split: str = "train",
    *,
    batch_size: int,
    image_size: int = 224,
    crop_ratio: float = 0.875,
    seed: int = 0,
    shuffle: bool | None = None,
    drop_last: bool | None = None,
    process_index: int = 0,
    process_count: int = 1,
    num_workers: int = 0,
    prefetch: int = 2,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
  ):
    self.folder = root if isinstance(root, ImageFolder) else ImageFolder.scan(root, split)
    if self.folder.split != split:
      raise ValueError(f"split: the folder given is the {self.folder.split!r} split, not {split!r}")
    self.batch_size = _check_int(batch_size, "batch_size", 1)
    self.image_size = _check_int(image_size, "image_size", 1)
    if not 0 < crop_ratio <= 1:
      raise ValueError(f"crop_ratio must be in (0, 1], got {crop_ratio!r}")
    self.crop_ratio = float(crop_ratio)
    self.seed = _check_int(seed, "seed", 0)
    self.process_count = _check_int(process_count, "process_count", 1)
    self.process_index = _check_int(process_index, "process_index", 0)
    if self.process_index >= self.process_count:
      raise ValueError(
        f"process_index must be < process_count ({self.process_count}), got {process_index}"
      )
    if self.process_count > len(self.folder):
      raise ValueError(
        f"process_count ({process_count}) exceeds the {len(self.folder)} images of the split"
      )
    self.num_workers = _check_int(num_workers, "num_workers", 0)
    self.prefetch = _check_int(prefetch, "prefetch", 1)
    train = split == "train"
    self.shuffle = train if shuffle is None else bool(shuffle)
    self.drop_last = train if drop_last is None else bool(drop_last)
    self.train = train
    mean_array, std_array = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    if mean_array.shape != (3,) or std_array.shape != (3,) or (std_array <= 0).any():
      raise ValueError(f"mean and std need 3 entries each, std > 0; got {mean} and {std}")
    self.mean, self.std = mean_array.reshape(1, 1, 1, 3), std_array.reshape(1, 1, 1, 3)
    self.epoch = 0
    self.step = 0

  @property
  def num_classes(self) -> int:
    return self.folder.num_classes

  @property
  def class_names(self) -> tuple[str, ...]:
    return self.folder.class_names

  def shard(self, epoch: int) -> np.ndarray:
    """Record indices of this process's images in ``epoch``, in serving order.

    Indices into ``folder.paths``, in the order they are served (before ``drop_last``'s cut to whole
    batches).
    """
    n, count = len(self.folder), self.process_count
    if self.shuffle:
      order = np.random.default_rng([self.seed, epoch, 0]).permutation(n)
    else:
      order = np.arange(n)
    mine = order[self.process_index :: count]
    return mine[: n // count] if self.drop_last else mine

  def __len__(self) -> int:
    """Batches per epoch on this process."""
    size = len(self.folder) // self.process_count if self.drop_last else len(self.shard(0))
    return size // self.batch_size if self.drop_last else -(-size // self.batch_size)

  def state(self) -> dict[str, int]:
    """The position: ``{"epoch": e, "step": s}`` (``s`` batches of epoch ``e`` served)."""
    return {"epoch": self.epoch, "step": self.step}

  def restore(self, state: dict[str, int]) -> None:
    """Continue from a :meth:`state` (of a loader with the same settings)."""
    epoch, step = _check_int(state["epoch"], "epoch", 0), _check_int(state["step"], "step", 0)
    if step > len(self):
      raise ValueError(f"step must be <= {len(self)} batches per epoch, got {step}")
    self.epoch, self.step = epoch, step

  def _batches(self, epoch: int, start_step: int) -> _Batches:
    order = self.shard(epoch)
    if self.drop_last:
      order = order[: len(self) * self.batch_size]
    # One seed per (seed, epoch, process, position): independent of workers and of resuming.
    base = np.random.default_rng([self.seed, epoch, 1, self.process_index])
    seeds = base.integers(0, 2**63 - 1, size=len(order), dtype=np.int64)
    start = start_step * self.batch_size
    return _Batches(
      self.folder.paths, self.folder.labels, order[start:], seeds[start:], self.batch_size
    )

  def iter_epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The batches of ``epoch`` from ``start_step`` on (does not move :attr:`epoch`)."""
    batches = self._batches(epoch, start_step)
    if len(batches) == 0:
      return
    if self.num_workers:
      script = unguarded_main_script()
      if script is not None:
        # Checked before any worker starts: each would re-run the whole script (a training
        # run included) before failing with only "Worker process was terminated".
        raise RuntimeError(
          f"ImageNetLoader(num_workers={self.num_workers}) spawns worker processes, which "
          f"re-run the main script {script} on start; it has no "
          f'`if __name__ == "__main__":` guard, so each worker would run it again and die: '
          f"{GUARD_ADVICE}"
        )
      if not flags.FLAGS.is_parsed():
        # grain's worker processes read absl flags (their defaults here); outside an absl app
        # nothing parses them, and reading unparsed flags raises.
        flags.FLAGS.mark_as_parsed()
      # grain ships the work to spawned workers with cloudpickle; by value, this module's
      # classes and functions arrive without the worker importing jaxprune (and with it JAX),
      # which took most of a worker's start.
      cloudpickle.register_pickle_by_value(sys.modules[__name__])
    loader = grain.DataLoader(
      data_source=batches,
      sampler=grain.samplers.IndexSampler(
        len(batches), shard_options=grain.sharding.NoSharding(), shuffle=False, num_epochs=1
      ),
      operations=[_DecodeBatch(self.train, self.image_size, self.crop_ratio)],
      worker_count=self.num_workers,
      worker_buffer_size=self.prefetch,
    )
    for images, labels in _explain_worker_death(loader, self.num_workers):
      yield (images.astype(np.float32) / np.float32(255.0) - self.mean) / self.std, labels

  def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for batch in self.iter_epoch(self.epoch, self.step):
      self.step += 1
      yield batch
    self.epoch += 1
    self.step = 0

"""CIFAR-10 (JPEG folder/tarball or official pickles) and CIFAR-100 (official pickles).

The pickles are read by an unpickler that resolves only what those files hold (dicts, lists,
bytes, strings, numbers, NumPy arrays): a file that names any other class or function, the way
a crafted pickle runs code, is refused before anything is called.
"""

from __future__ import annotations

import io
import pickle
import posixpath
from pathlib import Path

import numpy as np

from jaxprune.data import _cache
from jaxprune.data._archive import FileTree, open_tree
from jaxprune.data._decode import check_processes, decode_images
from jaxprune.data.dataset import Splits, make_splits

__all__ = ["CIFAR10_CLASSES", "read_cifar10", "read_cifar100"]

# The official class order (batches.meta); class index i is CIFAR10_CLASSES[i].
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
# Where to look inside a data folder, in order of preference.
CIFAR10_CANDIDATES = (
  "cifar10-jpeg.tar.gz",
  "cifar10-jpeg",
  "cifar-10-batches-py",
  "cifar-10-python.tar.gz",
)
CIFAR100_CANDIDATES = ("cifar-100-python", "cifar-100-python.tar.gz")

_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_SPLITS = ("train", "test")
_PIXELS = 32 * 32 * 3


def _siblings_prefix(tree: FileTree, required: tuple[str, ...]) -> str | None:
  """The folder prefix ("a/b/" or "") holding every file in ``required``, if any does."""
  for name in tree.names:
    folder, base = posixpath.split(name)
    if base == required[0]:
      prefix = folder + "/" if folder else ""
      if all(prefix + other in tree for other in required):
        return prefix
  return None


class _RefusedGlobal(pickle.UnpicklingError):
  """A pickle names a global that CIFAR's files do not hold."""


def _latin1_encode(text: str, encoding: str) -> bytes:
  # Python 3 writes bytes into protocol-2 pickles as ``_codecs.encode(text, "latin1")``.
  if encoding not in ("latin1", "latin-1"):
    raise _RefusedGlobal(f"_codecs.encode with encoding {encoding!r}")
  return text.encode("latin-1")


# The functions NumPy pickles arrays and scalars through, from the running NumPy: a pickle
# names them under NumPy 1's ``numpy.core`` or NumPy 2's ``numpy._core``, and neither module
# needs importing.
_NUMPY_FUNCTIONS = (
  ("multiarray", "_reconstruct", np.zeros(1).__reduce__()[0]),  # ndarray, protocols 0-4
  ("numeric", "_frombuffer", np.zeros(1).__reduce_ex__(5)[0]),  # ndarray, protocol 5
  ("multiarray", "scalar", np.int64(0).__reduce__()[0]),  # NumPy scalars
)
# (module, name) -> the object. Only what CIFAR's pickles (Python 2 cPickle: dicts, lists,
# bytes, strings, numbers and NumPy arrays) and Python 3 re-pickles of them name; every
# callable here builds data and runs nothing else.
_ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
  **{(m, "bytes"): bytes for m in ("builtins", "__builtin__")},
  **{(m, "bytearray"): bytearray for m in ("builtins", "__builtin__")},
  ("_codecs", "encode"): _latin1_encode,
  ("numpy", "ndarray"): np.ndarray,
  ("numpy", "dtype"): np.dtype,
  **{
    (f"{core}.{module}", name): function
    for core in ("numpy.core", "numpy._core")
    for module, name, function in _NUMPY_FUNCTIONS
  },
}


class _CifarUnpickler(pickle.Unpickler):
  """Resolves only :data:`_ALLOWED_GLOBALS`: a pickle that names any other class or function
  (the way a crafted ``__reduce__`` runs code) fails when the name is read, before any call,
  as ``torch.load(weights_only=True)`` restricts checkpoints."""

  def find_class(self, module: str, name: str) -> object:
    try:
      return _ALLOWED_GLOBALS[(module, name)]
    except KeyError:
      raise _RefusedGlobal(f"{module}.{name}") from None


def _load_pickle(tree: FileTree, name: str) -> dict[str, object]:
  # The official files are Python 2 pickles: bytes keys and strings, latin-1 safe. They are
  # read with an unpickler restricted to what they hold, so a file cannot run code.
  try:
    obj = _CifarUnpickler(io.BytesIO(bytes(tree.read(name))), encoding="bytes").load()
  except _RefusedGlobal as err:
    raise ValueError(
      f"{tree.description}: {name} refers to {err}, which a CIFAR pickle does not hold; it "
      "was not called and the file is not loaded (only dicts, lists, bytes, strings, numbers "
      "and NumPy arrays are read)"
    ) from None
  except (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    ImportError,
  ) as err:
    raise ValueError(f"{tree.description}: {name} is not a CIFAR pickle ({err})") from err
  if not isinstance(obj, dict):
    raise ValueError(f"{tree.description}: {name} holds a {type(obj).__name__}, expected a dict")
  return {
    key.decode("latin-1") if isinstance(key, bytes) else str(key): value
    for key, value in obj.items()
  }


def _batch_arrays(tree: FileTree, name: str, label_key: str) -> tuple[np.ndarray, np.ndarray]:
  batch = _load_pickle(tree, name)
  if "data" not in batch or label_key not in batch:
    raise ValueError(
      f"{tree.description}: {name} lacks 'data' or {label_key!r} (keys: {sorted(batch)})"
    )
  data = np.asarray(batch["data"])
  if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _PIXELS:
    raise ValueError(
      f"{tree.description}: {name} data must be uint8 of shape (N, {_PIXELS}), got {data.dtype} {data.shape}"
    )
  labels = np.asarray(batch[label_key])
  if labels.shape != (data.shape[0],) or labels.dtype.kind not in "iu":
    raise ValueError(
      f"{tree.description}: {name} has {labels.shape} labels for {data.shape[0]} images"
    )
  # Rows are channel-planar (1024 R, 1024 G, 1024 B), each plane row-major.
  images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return images, labels.astype(np.int32)


def _names_from_meta(tree: FileTree, name: str, key: str) -> tuple[str, ...] | None:
  if name not in tree:
    return None
  meta = _load_pickle(tree, name)
  if key not in meta:
    raise ValueError(f"{tree.description}: {name} lacks {key!r}")
  return tuple(n.decode("latin-1") if isinstance(n, bytes) else str(n) for n in meta[key])


def _check_label_range(tree: FileTree, labels: np.ndarray, num_classes: int) -> None:
  if labels.min() < 0 or labels.max() >= num_classes:
    raise ValueError(
      f"{tree.description}: labels span [{labels.min()}, {labels.max()}], expected [0, {num_classes})"
    )


def _cifar10_from_pickles(tree: FileTree, prefix: str) -> Splits:
  parts = [_batch_arrays(tree, f"{prefix}data_batch_{i}", "labels") for i in range(1, 6)]
  train_images = np.concatenate([images for images, _ in parts])
  train_labels = np.concatenate([labels for _, labels in parts])
  test_images, test_labels = _batch_arrays(tree, f"{prefix}test_batch", "labels")
  class_names = _names_from_meta(tree, f"{prefix}batches.meta", "label_names") or CIFAR10_CLASSES
  _check_label_range(tree, np.concatenate([train_labels, test_labels]), len(class_names))
  return make_splits(train_images, train_labels, test_images, test_labels, class_names)


def _jpeg_prefix(tree: FileTree) -> str | None:
  """The folder holding ``train/`` and ``test/`` of the JPEG layout, or None if there is none."""
  prefixes = set()
  for name in tree.names:
    parts = name.split("/")
    if len(parts) >= 3 and parts[-3] in _SPLITS and name.lower().endswith(_IMAGE_SUFFIXES):
      prefixes.add("/".join(parts[:-3]))
  if not prefixes:
    return None
  if len(prefixes) > 1:
    raise ValueError(
      f"{tree.description}: several CIFAR-10 image trees ({sorted(prefixes)}); point root at one"
    )
  prefix = prefixes.pop()
  return prefix + "/" if prefix else ""


def _jpeg_files(tree: FileTree, prefix: str, split: str) -> tuple[list[str], np.ndarray]:
  """File names in class-index order, then by their number NNNN, with their labels."""
  by_class: dict[str, list[tuple[int, str]]] = {}
  split_prefix = f"{prefix}{split}/"
  for name in tree.names:
    if not name.startswith(split_prefix) or not name.lower().endswith(_IMAGE_SUFFIXES):
      continue
    rest = name[len(split_prefix) :].split("/")
    if len(rest) != 2:
      raise ValueError(
        f"{tree.description}: unexpected file {name} (expected {split}/<class>/NNNN.jpg)"
      )
    class_name, file_name = rest
    stem = file_name.rsplit(".", 1)[0]
    if not stem.isdigit():
      raise ValueError(f"{tree.description}: {name} is not named NNNN.jpg")
    by_class.setdefault(class_name, []).append((int(stem), name))
  if not by_class:
    raise ValueError(f"{tree.description}: no images under {split_prefix}")
  missing = sorted(set(CIFAR10_CLASSES) - set(by_class))
  unexpected = sorted(set(by_class) - set(CIFAR10_CLASSES))
  if missing or unexpected:
    raise ValueError(
      f"{tree.description}: {split_prefix} class folders differ from CIFAR-10's: "
      f"missing {missing}, unexpected {unexpected}"
    )
  names: list[str] = []
  labels: list[int] = []
  for label, class_name in enumerate(CIFAR10_CLASSES):
    entries = sorted(by_class[class_name])
    numbers = [number for number, _ in entries]
    if numbers != list(range(len(numbers))):
      raise ValueError(
        f"{tree.description}: {split_prefix}{class_name}/ must hold 0000..{len(numbers) - 1:04d} "
        "without gaps or duplicates (a truncated or mixed-up copy?)"
      )
    names.extend(name for _, name in entries)
    labels.extend([label] * len(entries))
  return names, np.asarray(labels, dtype=np.int32)


def _cifar10_from_jpeg(tree: FileTree, prefix: str, processes: int | None) -> Splits:
  train_names, train_labels = _jpeg_files(tree, prefix, "train")
  test_names, test_labels = _jpeg_files(tree, prefix, "test")
  train_images = decode_images(tree, train_names, 32, 32, processes=processes)
  test_images = decode_images(tree, test_names, 32, 32, processes=processes)
  return make_splits(train_images, train_labels, test_images, test_labels, CIFAR10_CLASSES)


def read_cifar10(path: Path, cache_dir: Path, *, processes: int | None = None) -> Splits:
  """Reads CIFAR-10 from the JPEG layout or the official pickles, whichever ``path`` holds.

  ``path`` may be a folder or an archive (tar, tar.gz, zip). JPEG layout:
  ``[prefix/]{train,test}/<class>/NNNN.jpg`` with the ten official class folders; the images
  are ordered by class index, then NNNN, decoded once and cached under ``cache_dir``.
  Pickle layout: ``[prefix/]data_batch_1..5``, ``test_batch`` (``batches.meta`` optional),
  in the official order, read without running code (see the module docstring).
  ``processes``: how many processes decode JPEGs (see
  :func:`~jaxprune.data._decode.decode_images`; default one per core, ``1`` in this process).

  Raises:
    ValueError: neither layout is found, or the one found is incomplete or corrupt, or a
      pickle names a class or function that CIFAR's files do not hold (it is not called), or
      ``processes`` is not a positive int or None.
  """
  check_processes(processes)  # here, not only when a cold cache decodes
  tree = open_tree(path)
  cache_file = _cache.cache_path(cache_dir, "cifar10", tree.fingerprint())
  cached = _cache.read_cached(cache_file)
  if cached is not None:
    return cached
  pickle_prefix = _siblings_prefix(tree, ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                                            "data_batch_5", "test_batch"))  # fmt: skip
  if pickle_prefix is not None:
    return _cifar10_from_pickles(tree, pickle_prefix)  # already fast to read: not cached
  jpeg_prefix = _jpeg_prefix(tree)
  if jpeg_prefix is None:
    if any(posixpath.basename(n).startswith("data_batch_") for n in tree.names):
      raise ValueError(
        f"{tree.description}: incomplete CIFAR-10 pickles (need data_batch_1..5 and test_batch)"
      )
    raise ValueError(
      f"{tree.description} does not hold CIFAR-10: expected {{train,test}}/<class>/NNNN.jpg "
      "or the pickles data_batch_1..5 + test_batch"
    )
  return _cache.store(cache_file, _cifar10_from_jpeg(tree, jpeg_prefix, processes))


def read_cifar100(path: Path, label_mode: str = "fine") -> Splits:
  """Reads CIFAR-100 from the official pickles (``[prefix/]train``, ``test``, ``meta``).

  Args:
    path: folder or archive holding ``cifar-100-python``'s files.
    label_mode: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).

  Raises:
    ValueError: unknown ``label_mode``, files missing or corrupt, or a pickle that names a
      class or function CIFAR's files do not hold (read without running code, as CIFAR-10's).
  """
  if label_mode not in ("fine", "coarse"):
    raise ValueError(f"label_mode must be 'fine' or 'coarse', got {label_mode!r}")
  tree = open_tree(path)
  prefix = _siblings_prefix(tree, ("meta", "train", "test"))
  if prefix is None:
    raise ValueError(
      f"{tree.description} does not hold CIFAR-100: expected the pickles train, test and meta"
    )
  label_key = f"{label_mode}_labels"
  train_images, train_labels = _batch_arrays(tree, f"{prefix}train", label_key)
  test_images, test_labels = _batch_arrays(tree, f"{prefix}test", label_key)
  class_names = _names_from_meta(tree, f"{prefix}meta", f"{label_mode}_label_names")
  assert class_names is not None  # meta is required above
  _check_label_range(tree, np.concatenate([train_labels, test_labels]), len(class_names))
  return make_splits(train_images, train_labels, test_images, test_labels, class_names)

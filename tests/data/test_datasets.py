"""Tests for jaxprune.data's readers, against hand-built fake data sets (JPEG tarballs and
folders, CIFAR pickles, Tiny ImageNet, digits), their errors, the loader benchmark on a
fake tarball, and balanced subsets."""

from __future__ import annotations

import io
import os
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxprune import data
from jaxprune.data import _decode, cifar

REPO = Path(__file__).resolve().parents[2]
REAL_CIFAR10 = REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"
CLASSES = cifar.CIFAR10_CLASSES


# ---------------------------------------------------------------------------------------------
# Fake data sets
# ---------------------------------------------------------------------------------------------


def _colour(label: int, number: int, split: str) -> tuple[int, int, int]:
  """A flat colour encoding (class, number, split): survives JPEG to within a few levels."""
  return (20 + 22 * label, 30 + 40 * number, 60 if split == "train" else 200)


def _jpeg_bytes(colour, size=(32, 32), mode="RGB") -> bytes:
  buffer = io.BytesIO()
  Image.new(mode, size, colour).save(buffer, format="JPEG", quality=95)
  return buffer.getvalue()


def _write_jpeg_tree(root: Path, counts={"train": 3, "test": 2}, classes=CLASSES) -> Path:
  for split, count in counts.items():
    for label, name in enumerate(classes):
      folder = root / "cifar10-jpeg" / split / name
      folder.mkdir(parents=True)
      for number in range(count):
        (folder / f"{number:04d}.jpg").write_bytes(_jpeg_bytes(_colour(label, number, split)))
  return root / "cifar10-jpeg"


def _tar(source: Path, target: Path) -> Path:
  # Members added in reverse order so that the reader cannot rely on archive order.
  with tarfile.open(target, "w:gz") as archive:
    for path in sorted(source.rglob("*"), reverse=True):
      archive.add(path, arcname=path.relative_to(source.parent).as_posix(), recursive=False)
  return target


@pytest.fixture(scope="module")
def jpeg_tarball(tmp_path_factory) -> Path:
  root = tmp_path_factory.mktemp("jpeg")
  return _tar(_write_jpeg_tree(root), root / "cifar10-jpeg.tar.gz")


def _expected_colours(counts: int, split: str) -> np.ndarray:
  return np.array(
    [_colour(label, n, split) for label in range(10) for n in range(counts)], dtype=np.float64
  )


def _official_batch(
  images: np.ndarray, labels: np.ndarray, label_key=b"labels", extra=None
) -> dict:
  batch = {
    b"data": images.transpose(0, 3, 1, 2).reshape(len(images), -1),
    label_key: list(map(int, labels)),
  }
  batch.update(extra or {})
  return batch


def _dump(path: Path, obj) -> None:
  path.write_bytes(pickle.dumps(obj, protocol=2))


def _write_cifar10_pickles(
  root: Path, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  folder = root / "cifar-10-batches-py"
  folder.mkdir(parents=True)
  train_images = rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8)
  train_labels = rng.integers(0, 10, 20)
  test_images = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
  test_labels = rng.integers(0, 10, 6)
  for i in range(5):
    part = slice(4 * i, 4 * i + 4)
    _dump(folder / f"data_batch_{i + 1}", _official_batch(train_images[part], train_labels[part]))
  _dump(folder / "test_batch", _official_batch(test_images, test_labels))
  _dump(folder / "batches.meta", {b"label_names": [c.encode() for c in CLASSES]})
  return train_images, train_labels, test_images, test_labels


# ---------------------------------------------------------------------------------------------
# CIFAR-10 from JPEG
# ---------------------------------------------------------------------------------------------


def test_cifar10_jpeg_tarball_labels_order_shapes(jpeg_tarball, tmp_path):
  train = data.load("cifar10", root=jpeg_tarball, cache_dir=tmp_path)
  test = data.load("cifar10", root=jpeg_tarball, split="test", cache_dir=tmp_path)
  assert train.images.shape == (30, 32, 32, 3) and train.images.dtype == np.uint8
  assert test.images.shape == (20, 32, 32, 3)
  assert train.labels.dtype == np.int32
  np.testing.assert_array_equal(train.labels, np.repeat(np.arange(10), 3))
  np.testing.assert_array_equal(test.labels, np.repeat(np.arange(10), 2))
  assert train.class_names == CLASSES and train.num_classes == 10
  # Order: class index, then NNNN; each image's flat colour says which file it came from.
  np.testing.assert_allclose(train.images.mean(axis=(1, 2)), _expected_colours(3, "train"), atol=4)
  np.testing.assert_allclose(test.images.mean(axis=(1, 2)), _expected_colours(2, "test"), atol=4)
  # Both splits are normalised with the training statistics.
  assert test.mean == train.mean and test.std == train.std
  expected_mean, expected_std = data.channel_stats(train.images)
  np.testing.assert_allclose(train.mean, expected_mean)
  np.testing.assert_allclose(train.mean, (train.images / 255.0).mean(axis=(0, 1, 2)), rtol=1e-9)
  np.testing.assert_allclose(train.std, (train.images / 255.0).std(axis=(0, 1, 2)), rtol=1e-9)


def test_cifar10_folder_equals_tarball(jpeg_tarball, tmp_path):
  folder = _write_jpeg_tree(tmp_path / "unpacked")
  from_tar = data.load("cifar10", root=jpeg_tarball, cache_dir=tmp_path / "a")
  from_folder = data.load("cifar10", root=folder, cache_dir=tmp_path / "b")
  from_parent = data.load("cifar10", root=tmp_path / "unpacked", cache_dir=tmp_path / "b")
  np.testing.assert_array_equal(from_tar.images, from_folder.images)
  np.testing.assert_array_equal(from_tar.labels, from_folder.labels)
  np.testing.assert_array_equal(from_folder.images, from_parent.images)


def test_cifar10_cache_round_trip(jpeg_tarball, tmp_path, monkeypatch):
  cache_dir = tmp_path / "cache"
  first = data.load("cifar10", root=jpeg_tarball, cache_dir=cache_dir)
  files = list(cache_dir.iterdir())
  assert len(files) == 1 and files[0].suffix == ".npz"  # no temp file left behind

  def no_decoding(*args, **kwargs):
    raise AssertionError("decoded again despite the cache")

  monkeypatch.setattr(cifar, "decode_images", no_decoding)
  second = data.load("cifar10", root=jpeg_tarball, cache_dir=cache_dir)
  np.testing.assert_array_equal(first.images, second.images)
  np.testing.assert_array_equal(first.labels, second.labels)
  assert first.mean == second.mean and first.class_names == second.class_names

  # The environment variable selects the cache when no argument is given.
  monkeypatch.setenv(data.CACHE_ENV, str(cache_dir))
  np.testing.assert_array_equal(data.load("cifar10", root=jpeg_tarball).images, first.images)

  # A damaged cache file is decoded again and rewritten.
  files[0].write_bytes(b"not a zip file")
  monkeypatch.setattr(cifar, "decode_images", _decode.decode_images)
  third = data.load("cifar10", root=jpeg_tarball, cache_dir=cache_dir)
  np.testing.assert_array_equal(first.images, third.images)
  assert files[0].stat().st_size > 1000


def test_dataset_is_read_only(jpeg_tarball, tmp_path):
  train = data.load("cifar10", root=jpeg_tarball, cache_dir=tmp_path)
  with pytest.raises(ValueError):
    train.images[0, 0, 0, 0] = 1
  with pytest.raises(AttributeError):
    train.num_classes = 3  # type: ignore[misc]


def test_default_root_from_environment(jpeg_tarball, tmp_path, monkeypatch):
  monkeypatch.setenv(data.DATA_ENV, str(jpeg_tarball.parent))
  assert data.default_data_dir() == jpeg_tarball.parent
  assert len(data.load("cifar10", cache_dir=tmp_path)) == 30
  monkeypatch.setenv(data.DATA_ENV, str(tmp_path / "empty"))
  with pytest.raises(FileNotFoundError, match="cifar10"):
    data.load("cifar10", cache_dir=tmp_path)


# ---------------------------------------------------------------------------------------------
# Pickles
# ---------------------------------------------------------------------------------------------


def test_cifar10_pickles(tmp_path):
  train_images, train_labels, test_images, test_labels = _write_cifar10_pickles(tmp_path)
  for root in (tmp_path, tmp_path / "cifar-10-batches-py"):
    train = data.load("cifar10", root=root, cache_dir=tmp_path / "cache")
    test = data.load("cifar10", root=root, split="test", cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(train.images, train_images)  # exact: official order, no loss
    np.testing.assert_array_equal(train.labels, train_labels)
    np.testing.assert_array_equal(test.images, test_images)
    np.testing.assert_array_equal(test.labels, test_labels)
    assert train.class_names == CLASSES
  # Also straight from the official archive.
  with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as archive:
    archive.add(tmp_path / "cifar-10-batches-py", arcname="cifar-10-batches-py")
  train = data.load(
    "cifar10", root=tmp_path / "cifar-10-python.tar.gz", cache_dir=tmp_path / "cache"
  )
  np.testing.assert_array_equal(train.images, train_images)


def test_cifar100_pickles_fine_and_coarse(tmp_path):
  rng = np.random.default_rng(1)
  folder = tmp_path / "cifar-100-python"
  folder.mkdir()
  splits = {}
  for split, count in (("train", 12), ("test", 5)):
    images = rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)
    fine, coarse = rng.integers(0, 100, count), rng.integers(0, 20, count)
    extra = {b"coarse_labels": list(map(int, coarse))}
    _dump(folder / split, _official_batch(images, fine, b"fine_labels", extra))
    splits[split] = (images, fine, coarse)
  fine_names = [f"fine{i}".encode() for i in range(100)]
  coarse_names = [f"coarse{i}".encode() for i in range(20)]
  _dump(folder / "meta", {b"fine_label_names": fine_names, b"coarse_label_names": coarse_names})

  for split in ("train", "test"):
    images, fine, coarse = splits[split]
    ds = data.load("cifar100", root=tmp_path, split=split)
    np.testing.assert_array_equal(ds.images, images)
    np.testing.assert_array_equal(ds.labels, fine)
    assert ds.num_classes == 100 and ds.class_names[7] == "fine7"
    ds = data.load("cifar100-coarse", root=folder, split=split)
    np.testing.assert_array_equal(ds.labels, coarse)
    assert ds.num_classes == 20 and ds.class_names[3] == "coarse3"


# ---------------------------------------------------------------------------------------------
# Tiny ImageNet, digits
# ---------------------------------------------------------------------------------------------


def test_tiny_imagenet_layout(tmp_path):
  root = tmp_path / "tiny-imagenet-200"
  wnids = ["n02", "n01", "n03"]  # wnids.txt order; classes are numbered in sorted order
  (root / "val" / "images").mkdir(parents=True)
  (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
  for wnid in wnids:
    folder = root / "train" / wnid / "images"
    folder.mkdir(parents=True)
    for k in (0, 2, 10):  # 10 must come after 2
      (folder / f"{wnid}_{k}.JPEG").write_bytes(
        _jpeg_bytes((int(wnid[-1]) * 60, k * 20, 0), (64, 64))
      )
  # One greyscale image, converted to RGB.
  (root / "train" / "n01" / "images" / "n01_2.JPEG").write_bytes(_jpeg_bytes(128, (64, 64), "L"))
  annotations = [("val_1.JPEG", "n03"), ("val_0.JPEG", "n01")]
  for file_name, wnid in annotations:
    (root / "val" / "images" / file_name).write_bytes(
      _jpeg_bytes((int(wnid[-1]) * 60, 0, 250), (64, 64))
    )
  (root / "val" / "val_annotations.txt").write_text(
    "".join(f"{f}\t{w}\t0\t0\t63\t63\n" for f, w in annotations)
  )

  train = data.load("tiny-imagenet", root=tmp_path, cache_dir=tmp_path / "cache")
  val = data.load("tiny-imagenet", root=root, split="val", cache_dir=tmp_path / "cache")
  assert train.class_names == ("n01", "n02", "n03")
  assert train.images.shape == (9, 64, 64, 3) and val.images.shape == (2, 64, 64, 3)
  np.testing.assert_array_equal(train.labels, [0, 0, 0, 1, 1, 1, 2, 2, 2])
  green = train.images[..., 1].mean(axis=(1, 2))
  np.testing.assert_allclose(green[3:6], [0, 40, 200], atol=4)  # n02: files 0, 2, 10
  np.testing.assert_allclose(train.images[1].mean(axis=(0, 1)), [128, 128, 128], atol=3)
  np.testing.assert_array_equal(val.labels, [2, 0])  # annotation-file order
  np.testing.assert_allclose(val.images[:, ..., 0].mean(axis=(1, 2)), [180, 60], atol=4)
  assert val.split == "test"


def test_digits_split():
  from sklearn.datasets import load_digits

  train, test = data.load("digits"), data.load("digits", split="test")
  assert train.images.shape == (1437, 8, 8, 1) and test.images.shape == (360, 8, 8, 1)
  assert train.images.dtype == np.uint8 and train.images.max() == 255
  assert train.num_classes == 10 and train.image_shape == (8, 8, 1)
  # Stratified: every class keeps about 80% of its examples in training.
  reference = load_digits()
  all_counts = np.bincount(reference.target, minlength=10)
  np.testing.assert_allclose(np.bincount(train.labels, minlength=10) / all_counts, 0.8, atol=0.01)
  # The split partitions the original images (scaled 0..16 -> 0..255), labels attached.
  scaled = np.round(reference.images * 255 / 16).astype(np.uint8)
  originals = {(img.tobytes(), int(t)) for img, t in zip(scaled, reference.target)}
  loaded = [
    (img[..., 0].tobytes(), int(t)) for ds in (train, test) for img, t in zip(ds.images, ds.labels)
  ]
  assert len(loaded) == len(reference.target) and set(loaded) == originals
  # Deterministic.
  np.testing.assert_array_equal(data.load("digits").images, train.images)


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


def test_load_rejects_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match="unknown data set name 'mnist'"):
    data.load("mnist")
  with pytest.raises(ValueError, match="split"):
    data.load("digits", split="validation")
  with pytest.raises(ValueError, match="root"):
    data.load("digits", root=tmp_path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    data.load("cifar10", root=tmp_path / "nowhere")
  (tmp_path / "junk.tar.gz").write_bytes(b"\x1f\x8b not really gzip")
  with pytest.raises(ValueError, match="corrupt compressed archive"):
    data.load("cifar10", root=tmp_path / "junk.tar.gz", cache_dir=tmp_path)
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="does not hold CIFAR-10"):
    data.load("cifar10", root=tmp_path / "empty", cache_dir=tmp_path)


def test_corrupt_jpeg_layouts(tmp_path):
  cache = tmp_path / "cache"
  tree = _write_jpeg_tree(tmp_path / "missing_class", {"train": 1, "test": 1})
  for f in (tree / "test" / "truck").iterdir():
    f.unlink()
  (tree / "test" / "truck").rmdir()
  with pytest.raises(ValueError, match=r"missing \['truck'\]"):
    data.load("cifar10", root=tree, cache_dir=cache)

  tree = _write_jpeg_tree(tmp_path / "gap", {"train": 3, "test": 1})
  (tree / "train" / "cat" / "0001.jpg").unlink()
  with pytest.raises(ValueError, match="gaps"):
    data.load("cifar10", root=tree, cache_dir=cache)

  tree = _write_jpeg_tree(tmp_path / "size", {"train": 1, "test": 1})
  (tree / "train" / "dog" / "0000.jpg").write_bytes(_jpeg_bytes((1, 2, 3), (31, 32)))
  with pytest.raises(ValueError, match=r"train/dog/0000.jpg is 31x32, expected 32x32"):
    data.load("cifar10", root=tree, cache_dir=cache)

  tree = _write_jpeg_tree(tmp_path / "garbage", {"train": 1, "test": 1})
  (tree / "test" / "ship" / "0000.jpg").write_bytes(b"garbage")
  with pytest.raises(ValueError, match="cannot decode .*test/ship/0000.jpg"):
    data.load("cifar10", root=tree, cache_dir=cache)


def test_corrupt_pickles(tmp_path):
  _write_cifar10_pickles(tmp_path)
  folder = tmp_path / "cifar-10-batches-py"
  _dump(folder / "data_batch_3", {b"data": np.zeros((4, 100), np.uint8), b"labels": [0] * 4})
  with pytest.raises(ValueError, match=r"data_batch_3 data must be uint8 of shape \(N, 3072\)"):
    data.load("cifar10", root=folder)
  _dump(folder / "data_batch_3", {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0] * 3})
  with pytest.raises(ValueError, match="data_batch_3 has"):
    data.load("cifar10", root=folder)
  (folder / "data_batch_3").write_bytes(b"not a pickle")
  with pytest.raises(ValueError, match="data_batch_3 is not a CIFAR pickle"):
    data.load("cifar10", root=folder)
  (folder / "data_batch_3").unlink()
  with pytest.raises(ValueError, match="incomplete CIFAR-10 pickles"):
    data.load("cifar10", root=folder, cache_dir=tmp_path / "cache")


class _CallsOnLoad:
  """Unpickles as ``function(*args)``: what a crafted pickle makes ``pickle.loads`` run."""

  def __init__(self, function, *args):
    self.function, self.args = function, args

  def __reduce__(self):
    return self.function, self.args


@pytest.mark.parametrize("member", ["data_batch_2", "batches.meta"])
def test_crafted_pickle_is_refused_without_calling_its_function(tmp_path, member):
  """A pickle whose ``__reduce__`` names a function (here ``os.mkdir`` in a batch, ``exec``
  in the meta file) is refused with an error naming the function, and the function never
  runs: the folder it would create does not exist afterwards."""
  _write_cifar10_pickles(tmp_path)
  folder = tmp_path / "cifar-10-batches-py"
  marker = tmp_path / "was-called"
  if member == "data_batch_2":
    payload = {b"data": _CallsOnLoad(os.mkdir, str(marker)), b"labels": [0]}
    named = "mkdir"
  else:
    payload = {b"label_names": _CallsOnLoad(exec, f"import os; os.mkdir({str(marker)!r})")}
    named = "exec"
  _dump(folder / member, payload)
  with pytest.raises(ValueError, match=rf"{member} refers to \S*\.{named}.*not called"):
    data.load("cifar10", root=folder, cache_dir=tmp_path / "cache")
  assert not marker.exists()


class _Python2Pickler(pickle._Pickler):
  """Writes ``bytes`` as Python 2 ``str`` (``SHORT_BINSTRING`` / ``BINSTRING``), as the
  official CIFAR files (Python 2 ``cPickle``) hold their keys, names and pixels."""

  dispatch = dict(pickle._Pickler.dispatch)

  def _save_str8(self, obj):
    if len(obj) < 256:
      self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
    else:
      self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
    self.memoize(obj)

  dispatch[bytes] = _save_str8


def test_official_python2_pickle_format_still_loads(tmp_path):
  """The restricted reader takes what the official files hold: Python 2 strings and arrays
  rebuilt through NumPy 1's ``numpy.core.multiarray._reconstruct``."""
  train_images, train_labels, test_images, test_labels = _write_cifar10_pickles(tmp_path)
  folder = tmp_path / "cifar-10-batches-py"
  for i in range(1, 6):
    batch = slice(4 * (i - 1), 4 * i)
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(
      _official_batch(train_images[batch], train_labels[batch])
    )
    raw = buffer.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert b"numpy.core.multiarray\n_reconstruct" in raw and b"_codecs" not in raw
    (folder / f"data_batch_{i}").write_bytes(raw)
  train = data.load("cifar10", root=folder, cache_dir=tmp_path / "cache")
  np.testing.assert_array_equal(train.images, train_images)
  np.testing.assert_array_equal(train.labels, train_labels)


def test_dataset_validation():
  images = np.zeros((4, 8, 8, 3), np.uint8)
  with pytest.raises(ValueError, match="uint8"):
    data.Dataset.from_arrays(images.astype(np.float32), [0, 1, 0, 1])
  with pytest.raises(ValueError, match="NHWC"):
    data.Dataset.from_arrays(images[0], [0, 1, 0, 1])
  with pytest.raises(ValueError, match="3 labels for 4 images"):
    data.Dataset.from_arrays(images, [0, 1, 0])
  with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
    data.Dataset.from_arrays(images, [0, 1, 0, 2], num_classes=2)
  with pytest.raises(ValueError, match="one per channel"):
    data.Dataset.from_arrays(images, [0, 1, 0, 1], mean=(0.5,), std=(0.2,))
  ds = data.Dataset.from_arrays(images, [0, 1, 0, 1], mean=(0.5,) * 3, std=(0.2,) * 3)
  sub = ds.subset([1, 3])
  assert len(sub) == 2 and sub.labels.tolist() == [1, 1] and sub.mean == ds.mean
  with pytest.raises(ValueError, match="std must be positive"):
    data.Dataset.from_arrays(images, [0, 1, 0, 1], mean=(0.5,) * 3, std=(0.2, 0.0, 0.2))
  constant = data.Dataset.from_arrays(images, [0, 1, 0, 1])  # no spread: scale left alone
  assert constant.mean == (0.0,) * 3 and constant.std == (1.0,) * 3


@pytest.mark.skipif(not REAL_CIFAR10.exists(), reason="CIFAR-10 tarball not available")
def test_real_cifar10_counts():
  # Decodes 60 000 JPEGs on the first run only; the cache ($JAXPRUNE_CACHE or ~/.cache/jaxprune)
  # serves every later run.
  train = data.load("cifar10", root=REAL_CIFAR10)
  test = data.load("cifar10", root=REAL_CIFAR10, split="test")
  assert train.images.shape == (50000, 32, 32, 3) and test.images.shape == (10000, 32, 32, 3)
  np.testing.assert_array_equal(np.bincount(train.labels), [5000] * 10)
  np.testing.assert_array_equal(np.bincount(test.labels), [1000] * 10)
  np.testing.assert_allclose(
    train.mean, (0.4914, 0.4822, 0.4465), atol=0.003
  )  # the known CIFAR-10 means


def test_bench_loader_writes_tables(jpeg_tarball, tmp_path):
  from experiments.benchmarks import loader as bench_loader

  out = tmp_path / "throughput.md"
  argv = ["--root", str(jpeg_tarball), "--cache-dir", str(tmp_path / "cache"), "--batch-sizes", "8",
            "--threads", "1", "--presets", "none,sdgp", "--out", str(out)]  # fmt: skip
  result = bench_loader.main(argv)
  assert [(r["preset"], r["threads"]) for r in result["rows"]] == [
    ("none", 1),
    ("none", 0),
    ("sdgp", 1),
    ("sdgp", 0),
  ]
  assert all(r["images_per_s"] > 0 for r in result["rows"])
  table = out.read_text()
  assert "| sdgp | 8 | 0 |" in table and out.with_suffix(".json").exists()


def test_bench_decode_writes_tables(jpeg_tarball, tmp_path, monkeypatch):
  from experiments.benchmarks import decode as bench_decode
  from experiments.common import pages

  monkeypatch.setattr(pages, "SCRATCH", tmp_path / "runs")
  monkeypatch.setattr(_decode, "_MIN_IMAGES_PER_PROCESS", 10)  # 50 images: a pool of 2
  result = bench_decode.main(["--root", str(jpeg_tarball), "--processes", "1,2", "--repeats", "1"])
  assert [(r["processes"], r["images"]) for r in result["rows"]] == [(1, 50), (2, 50)]
  assert result["rows"][0]["cpu_workers_s"] == 0 < result["rows"][1]["cpu_workers_s"]
  page = (tmp_path / "runs" / "benchmarks" / "decode_cpu.md").read_text()
  assert "| 2 |" in page and "Estimate for a 16-core host" in page and "Command: `python -m" in page


def test_balanced_subset_equal_class_counts_and_seeded():
  labels = np.array([0] * 7 + [1] * 5 + [2] * 9, dtype=np.int32)
  images = np.arange(len(labels) * 2 * 2, dtype=np.uint8).reshape(len(labels), 2, 2, 1)
  dataset = data.Dataset.from_arrays(images, labels, num_classes=3)
  subset = dataset.balanced_subset(13, seed=1)  # 13 // 3 = 4 per class
  assert np.bincount(subset.labels, minlength=3).tolist() == [4, 4, 4]
  # Every picked example is a row of the original, in original order, no repeats.
  rows = [int(np.flatnonzero((images == image).all(axis=(1, 2, 3)))[0]) for image in subset.images]
  assert rows == sorted(set(rows)) and (labels[rows] == subset.labels).all()
  again = dataset.balanced_subset(13, seed=1)
  assert (again.images == subset.images).all()
  other_seeds = [dataset.balanced_subset(13, seed=s).images for s in range(2, 6)]
  assert any((o != subset.images).any() for o in other_seeds)
  assert dataset.balanced_subset(None) is dataset
  assert dataset.balanced_subset(len(dataset)) is dataset
  with pytest.raises(ValueError, match="size"):
    dataset.balanced_subset(2)

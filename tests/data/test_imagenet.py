"""The ImageNet folder pipeline on a tiny generated folder of JPEGs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxprune import data
from jaxprune.data import imagenet
from jaxprune.data.imagenet import ImageFolder, ImageNetLoader

# Created out of order: labels must follow the sorted names, not the creation order.
CLASSES = ("n03", "n01", "n02")
# Image sizes (height, width): landscape, portrait and square, so crops see all three.
SIZES = ((40, 50), (52, 36), (30, 30), (44, 60), (36, 48))
COLOURS = {"n01": (200, 30, 30), "n02": (30, 200, 30), "n03": (30, 30, 200)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """``train/`` with 5 JPEGs per class, ``val/`` with 2; each class one flat colour + noise."""
  root = tmp_path_factory.mktemp("imagenet")
  rng = np.random.default_rng(0)
  for split, count in (("train", 5), ("val", 2)):
    for name in CLASSES:
      (root / split / name).mkdir(parents=True)
      for i in range(count):
        h, w = SIZES[i]
        pixels = np.asarray(COLOURS[name], np.int16) + rng.integers(-20, 21, (h, w, 3))
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(
          root / split / name / f"{name}_{i}.JPEG", quality=90
        )
  (root / "train" / "n01" / "notes.txt").write_text("not an image")
  return root


def test_labels_come_from_sorted_folder_names(folder):
  train = ImageFolder.scan(folder, "train")
  assert train.class_names == ("n01", "n02", "n03")
  assert len(train) == 15 and train.labels.dtype == np.int32
  for path, label in zip(train.paths, train.labels):
    assert path.split("/")[-2] == train.class_names[label]
  assert train.paths == tuple(sorted(train.paths))  # class by class, files sorted
  val = ImageFolder.scan(folder, "val")
  assert val.class_names == train.class_names and len(val) == 6


def test_batches_have_shape_dtype_normalisation_and_their_own_labels(folder):
  loader = ImageNetLoader(folder, "val", batch_size=4, image_size=16)
  batches = list(loader)
  assert [x.shape for x, _ in batches] == [(4, 16, 16, 3), (2, 16, 16, 3)]
  for x, labels in batches:
    assert x.dtype == np.float32 and labels.dtype == np.int32
    pixels = x * np.asarray(imagenet.IMAGENET_STD) + np.asarray(imagenet.IMAGENET_MEAN)
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    for image, label in zip(pixels, labels):  # the image's colour is its class's
      colour = np.asarray(COLOURS[loader.class_names[label]]) / 255
      np.testing.assert_allclose(image.mean(axis=(0, 1)), colour, atol=0.06)
  assert loader.epoch == 1 and loader.step == 0


@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_process_shards_are_disjoint_and_cover_the_epoch(folder, count, drop_last):
  shards = [
    ImageNetLoader(folder, "train", batch_size=2, process_index=p, process_count=count,
                   drop_last=drop_last, seed=5)
    for p in range(count)
  ]  # fmt: skip
  for epoch in (0, 1):
    parts = [s.shard(epoch) for s in shards]
    served = np.concatenate(parts)
    assert len(set(served.tolist())) == len(served)  # disjoint
    if drop_last:
      # cut to the same size everywhere: at most count - 1 images left out
      assert {len(p) for p in parts} == {15 // count}
      assert len({len(s) for s in shards}) == 1
    else:
      assert sorted(served.tolist()) == list(range(15))  # every image exactly once
  assert not np.array_equal(shards[0].shard(0), shards[0].shard(1))  # reshuffled per epoch
  # What a process serves is its shard: its labels, in order, cut to whole batches.
  first = shards[-1]
  labels = np.concatenate([y for _, y in first.iter_epoch(0)])
  expected = first.folder.labels[first.shard(0)]
  np.testing.assert_array_equal(labels, expected[: len(labels)])
  assert len(labels) == (len(first) * 2 if drop_last else len(expected))


def test_training_batches_are_a_function_of_seed_epoch_and_step(folder):
  def run(seed, **kw):
    loader = ImageNetLoader(folder, "train", batch_size=4, image_size=12, seed=seed, **kw)
    return [[x for x, _ in loader] for _ in range(2)]

  first, again, other = run(1), run(1), run(2)
  for a, b in zip(first, again):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y)
  assert not np.array_equal(first[0][0], other[0][0])
  assert not np.array_equal(first[0][0], first[1][0])  # a new epoch, new order and crops
  # Resume in the middle of epoch 1: the rest of the epoch is what the full run saw.
  resumed = ImageNetLoader(folder, "train", batch_size=4, image_size=12, seed=1)
  resumed.restore({"epoch": 1, "step": 1})
  rest = [x for x, _ in resumed]
  assert len(rest) == len(first[1]) - 1
  for x, y in zip(rest, first[1][1:]):
    np.testing.assert_array_equal(x, y)
  assert resumed.state() == {"epoch": 2, "step": 0}


def test_eval_view_by_hand_and_deterministic(folder):
  image = Image.open(folder / "val" / "n02" / "n02_0.JPEG").convert("RGB")  # 40 x 50 (h x w)
  view = imagenet.center_crop(image, 16, 0.875)
  # shorter side 40 -> round(16 / 0.875) = 18; width 50 * 18 / 40 = 22.5 -> 22; centre 16 x 16
  reference = np.asarray(image.resize((22, 18), Image.BILINEAR))[1:17, 3:19]
  np.testing.assert_array_equal(view, reference)
  np.testing.assert_array_equal(imagenet.center_crop(image, 16, 0.875), view)
  a = [x for x, _ in ImageNetLoader(folder, "val", batch_size=3, image_size=16, seed=0)]
  b = [x for x, _ in ImageNetLoader(folder, "val", batch_size=3, image_size=16, seed=9)]
  for x, y in zip(a, b):  # no randomness at evaluation, whatever the seed
    np.testing.assert_array_equal(x, y)


def test_random_resized_crop_box_and_view_against_a_reference():
  rng = np.random.default_rng(0)
  for _ in range(200):
    h, w = (int(v) for v in rng.integers(8, 300, 2))
    top, left, ch, cw = imagenet.random_resized_crop_box(h, w, rng)
    assert 0 <= top and top + ch <= h and 0 <= left and left + cw <= w
    if (ch, cw) != (h, w) and ch * cw > 400:  # not the fallback, not rounding-dominated
      assert 0.07 <= ch * cw / (h * w) <= 1.0
      assert 3 / 4 * 0.9 <= cw / ch <= 4 / 3 * 1.1
  # No box of >= 8% area fits a 10 x 200 strip at ratio <= 4/3: the centred fallback,
  # clamped to ratio 4/3: h 10, w round(13.3) = 13, left (200 - 13) // 2 = 93.
  assert imagenet.random_resized_crop_box(10, 200, rng) == (0, 93, 10, 13)
  # The view is the box cropped, resized bilinearly and flipped on the generator's coin.
  pixels = np.random.default_rng(1).integers(0, 256, (37, 53, 3), dtype=np.uint8)
  image = Image.fromarray(pixels)
  for seed in range(6):
    view = imagenet.random_resized_crop(image, 16, np.random.default_rng(seed))
    replay = np.random.default_rng(seed)
    top, left, ch, cw = imagenet.random_resized_crop_box(37, 53, replay)
    crop = Image.fromarray(pixels[top : top + ch, left : left + cw])
    reference = np.asarray(crop.resize((16, 16), Image.BILINEAR))
    if replay.random() < 0.5:
      reference = reference[:, ::-1]
    assert view.shape == (16, 16, 3) and view.dtype == np.uint8
    # PIL's box resize may read a pixel past the crop edge for its filter support.
    diff = np.abs(view.astype(int) - reference)
    assert np.median(diff) <= 1 and diff[2:-2, 2:-2].max() <= 2


def test_registry_opens_imagenet_as_a_stream(folder):
  assert "imagenet" in data.available_streams() and "imagenet" not in data.available()
  loader = data.open_stream("imagenet", root=folder, split="val", batch_size=6, image_size=8)
  assert isinstance(loader, ImageNetLoader) and len(loader) == 1
  with pytest.raises(
    ValueError, match="^imagenet does not fit in memory: open it with open_stream"
  ):
    data.load("imagenet", root=folder)
  with pytest.raises(ValueError, match="^split must be one of"):
    data.open_stream("imagenet", root=folder, split="test", batch_size=2)
  with pytest.raises(ValueError, match="^unknown streamed data set"):
    data.open_stream("cifar10", root=folder, batch_size=2)


def test_bad_arguments(folder, tmp_path):
  make = lambda **kw: ImageNetLoader(folder, "train", **{"batch_size": 2, **kw})
  for kwargs, name in (
    ({"batch_size": 0}, "batch_size"),
    ({"process_index": 2, "process_count": 2}, "process_index"),
    ({"process_count": 0}, "process_count"),
    ({"process_count": 16}, "process_count"),
    ({"num_workers": -1}, "num_workers"),
    ({"seed": -1}, "seed"),
    ({"crop_ratio": 0.0}, "crop_ratio"),
    ({"image_size": True}, "image_size"),
    ({"std": (0.2, 0.2)}, "mean and std"),
  ):
    with pytest.raises(ValueError, match=f"^{name}"):
      make(**kwargs)
  with pytest.raises(ValueError, match="^split must be one of"):
    ImageFolder.scan(folder, "test")
  with pytest.raises(FileNotFoundError, match="^root: "):
    ImageFolder.scan(tmp_path, "train")
  (tmp_path / "train" / "a").mkdir(parents=True)
  (tmp_path / "val" / "b").mkdir(parents=True)
  with pytest.raises(ValueError, match="^root: val/b is not a class of"):
    ImageFolder.scan(tmp_path, "val")
  with pytest.raises(ValueError, match="holds no images"):
    ImageFolder.scan(tmp_path, "train")
  with pytest.raises(ValueError, match="^step must be <="):
    make().restore({"epoch": 0, "step": 99})


@pytest.mark.slow
def test_worker_processes_give_the_same_batches(folder):
  """Decoding in 2 worker processes (spawned: a few seconds to start) changes nothing."""
  kwargs = {"batch_size": 4, "image_size": 12, "seed": 3}
  serial = [x for x, _ in ImageNetLoader(folder, "train", **kwargs)]
  parallel = [x for x, _ in ImageNetLoader(folder, "train", num_workers=2, **kwargs)]
  assert len(serial) == len(parallel) == 3
  for x, y in zip(serial, parallel):
    np.testing.assert_array_equal(x, y)


# A script that iterates a loader with worker processes; {guard} is how it guards that.
_WORKER_SCRIPT = """
import pathlib
from jaxprune.data.imagenet import ImageNetLoader

with open({runs!r}, "a") as runs:  # one line per execution of this script's top level
  runs.write("ran\\n")


def main():
  loader = ImageNetLoader({root!r}, "train", batch_size=4, image_size=8, num_workers=1)
  print("batches", sum(1 for _ in loader))

{guard}
"""


def _run_worker_script(tmp_path, folder, guard):
  runs = tmp_path / "runs.txt"
  script = tmp_path / "train_script.py"
  script.write_text(_WORKER_SCRIPT.format(runs=str(runs), root=str(folder), guard=guard))
  # This checkout's jaxprune, whatever the interpreter has installed.
  root = str(Path(__file__).resolve().parents[2])
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  proc = subprocess.run(
    [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
  )
  return proc, runs.read_text().count("ran") if runs.exists() else 0


def test_script_without_main_guard_is_told_what_to_do_before_workers_start(folder, tmp_path):
  """Workers are spawned and re-run the main script: without an ``if __name__ ==
  "__main__":`` guard each would run the whole script again and die. The loader says so,
  naming the script, before any worker starts (the script's top level ran once)."""
  proc, runs = _run_worker_script(tmp_path, folder, guard="main()")
  assert proc.returncode != 0
  assert "RuntimeError" in proc.stderr and 'if __name__ == "__main__":' in proc.stderr
  assert "train_script.py" in proc.stderr and "num_workers=0" in proc.stderr
  assert "Worker process was terminated" not in proc.stderr
  assert runs == 1


def test_unguarded_main_detection(tmp_path, monkeypatch):
  """Which main modules spawned workers would re-run without a guard: a script file or a
  ``python -m`` module lacking the guard; not a guarded one, an interactive session (no
  file) or a package's ``__main__`` (multiprocessing does not re-run those)."""
  import types

  from jaxprune.data import _spawn

  def main_module(source, spec_name=None, has_file=True):
    module = types.ModuleType("__main__")
    if has_file:
      path = tmp_path / f"script{len(list(tmp_path.iterdir()))}.py"
      path.write_text(source)
      module.__file__ = str(path)
    module.__spec__ = types.SimpleNamespace(name=spec_name) if spec_name else None
    monkeypatch.setitem(sys.modules, "__main__", module)
    return module

  unguarded = "import x\nx.run()\n"
  for guard in ('if __name__ == "__main__":\n  x.run()\n', "if '__main__' == __name__: pass\n"):
    main_module("import x\n" + guard)
    assert _spawn.unguarded_main_script() is None
  module = main_module(unguarded)
  assert _spawn.unguarded_main_script() == module.__file__
  module = main_module(unguarded, spec_name="mypackage.train")
  assert _spawn.unguarded_main_script() == module.__file__
  main_module(unguarded, spec_name="mypackage.__main__")
  assert _spawn.unguarded_main_script() is None
  main_module(unguarded, has_file=False)
  assert _spawn.unguarded_main_script() is None


def test_worker_death_is_explained(folder, monkeypatch):
  """When a worker dies anyway (a guarded script that still runs the loader on import, a
  crash in decoding), grain's bare "Worker process was terminated" becomes an error that
  names the loader and says what to check and what to do."""

  class DeadWorkers:
    def __init__(self, **kwargs):
      del kwargs

    def __iter__(self):
      raise RuntimeError("Worker process was terminated unexpectedly with exit code 1.")

  monkeypatch.setattr(imagenet.grain, "DataLoader", DeadWorkers)
  loader = ImageNetLoader(folder, "train", batch_size=4, num_workers=2)
  with pytest.raises(RuntimeError, match="worker process .* died") as info:
    next(iter(loader))
  message = str(info.value)
  assert 'if __name__ == "__main__":' in message and "num_workers=0" in message
  assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.slow
def test_guarded_script_that_still_runs_the_loader_on_import_gets_the_explanation(
  folder, tmp_path
):
  """End to end: the guard is there but the loader runs before it; the spawned worker re-runs
  it and dies, and the parent's error explains that instead of grain's bare message."""
  proc, _ = _run_worker_script(tmp_path, folder, guard='main()\nif __name__ == "__main__":\n  pass')
  assert proc.returncode != 0
  assert "worker process" in proc.stderr and 'if __name__ == "__main__":' in proc.stderr

"""The ImageNet loader benchmark: folder generation and its (scratch by default) results page."""

import json

from PIL import Image

from experiments.benchmarks import imagenet_loader as bench
from experiments.common import pages


def test_bench_times_each_split_and_writes_scratch_unless_published(tmp_path, monkeypatch):
  monkeypatch.setattr(pages, "RESULTS", tmp_path / "results")
  monkeypatch.setattr(pages, "SCRATCH", tmp_path / "runs")
  folder = tmp_path / "folder"
  argv = ["--images", "12", "--workers", "0", "--batch-size", "4", "--image-size", "16"]
  result = bench.main([*argv, "--folder", str(folder)])
  assert result["num_images"] == {"train": 12, "val": 10}
  # ten classes, ImageNet-like sizes (shorter side 300-449, ratio up to 4:3)
  assert len(list((folder / "train").iterdir())) == 10
  for path in sorted(folder.rglob("*.JPEG"))[:5]:
    with Image.open(path) as image:
      assert 300 <= min(image.size) < 450 and max(image.size) / min(image.size) <= 4 / 3 + 0.01
  assert [(r["split"], r["workers"], r["images"]) for r in result["rows"]] == [
    ("train", 0, 12),  # drop_last: 3 whole batches
    ("val", 0, 10),  # every image, last batch short
  ]
  page = tmp_path / "runs" / "benchmarks" / f"{bench.NAME}.md"
  assert (
    "| train | 0 |" in page.read_text()
    and "Command: `python -m experiments.run" in page.read_text()
  )
  assert json.loads(page.with_suffix(".json").read_text())["rows"] == result["rows"]
  assert not (tmp_path / "results").exists()
  bench.main([*argv, "--folder", str(folder), "--workers", "0", "--publish"])
  assert (tmp_path / "results" / "benchmarks" / f"{bench.NAME}.md").exists()

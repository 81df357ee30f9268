"""ImageNet pipeline throughput on CPU: images/second of ``ImageNetLoader`` on a generated folder.

Writes ``--images`` JPEGs (ImageNet-like sizes, 3:4 to 4:3 and about 500 x 375 on average, a
smooth pattern plus noise, quality 90) in the ImageNet folder layout to a temporary folder, then
times one epoch of the training view (random resized crop 224 + flip) and of the evaluation
view (resize 256 + centre crop 224) at each number of worker processes (0 = decoded in the
consuming process). The consumer does nothing with the batches.

    python -m experiments.run bench_imagenet_loader [--images 2000] [--workers 0,1,2] [--publish]

Writes ``runs/benchmarks/imagenet_loader_throughput.md`` (scratch, git-ignored) unless
``--publish`` (then ``experiments/results/benchmarks/``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from experiments.common import cli, pages
from experiments.common.machine import cpu_description
from jaxprune.data.imagenet import ImageNetLoader

NAME = "imagenet_loader_throughput"


def make_folder(root: Path, num_images: int, num_classes: int = 10, seed: int = 0) -> None:
  """``num_images`` JPEGs in ``root/train/<class>/`` (and a tenth as many in ``val/``)."""
  rng = np.random.default_rng(seed)
  for split, count in (("train", num_images), ("val", max(num_classes, num_images // 10))):
    for i in range(count):
      folder = root / split / f"n{i % num_classes:08d}"
      folder.mkdir(parents=True, exist_ok=True)
      short = int(rng.integers(300, 450))
      long = int(short * rng.uniform(1.0, 4 / 3))
      h, w = (short, long) if rng.random() < 0.75 else (long, short)
      y, x = np.mgrid[0:h, 0:w] / max(h, w)
      phase = rng.uniform(0, 6.3, 3)
      base = 127 + 100 * np.sin(6 * x[..., None] + 4 * y[..., None] + phase)
      pixels = base + rng.normal(0, 12, (h, w, 3))
      Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(
        folder / f"{i:06d}.JPEG", quality=90
      )


def _time_epoch(loader: ImageNetLoader) -> dict[str, float]:
  """Wall time of one epoch, time to the first batch, and the rate after it."""
  start = time.perf_counter()
  first = None
  images = after_first = 0
  for x, _ in loader:
    now = time.perf_counter()
    if first is None:
      first = now
    else:
      after_first += x.shape[0]
    images += x.shape[0]
  end = time.perf_counter()
  return {
    "images": images,
    "images_per_s": images / (end - start),
    "first_batch_s": (first or end) - start,
    "steady_images_per_s": after_first / max(end - (first or end), 1e-9),
  }


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="bench_imagenet_loader", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--images", type=int, default=2000, help="training JPEGs to generate")
  parser.add_argument("--workers", default="0,1,2", help="worker process counts to time")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--image-size", type=int, default=224)
  parser.add_argument("--folder", default=None, help="reuse / keep the generated folder here")
  cli.add_publish_argument(parser, "benchmarks/")
  args = parser.parse_args(argv)
  if args.images < 10:
    parser.error("--images must be at least 10")
  return args


def main(argv: list[str] | None = None) -> dict:
  args = _parse(argv)
  workers = [int(w) for w in args.workers.split(",")]
  with tempfile.TemporaryDirectory() as scratch:
    root = Path(args.folder or scratch)
    start = time.perf_counter()
    if not (root / "train").is_dir():
      make_folder(root, args.images)
    generate_s = time.perf_counter() - start
    size_mb = sum(f.stat().st_size for f in root.rglob("*.JPEG")) / 1e6
    load_before = os.getloadavg()[0]
    rows = []
    for split in ("train", "val"):
      for count in workers:
        loader = ImageNetLoader(
          root, split, batch_size=args.batch_size, image_size=args.image_size, num_workers=count
        )
        row = {"split": split, "workers": count, **_time_epoch(loader)}
        rows.append(row)
        print(
          f"{split:>5} workers {count}: {row['images_per_s']:7.1f} img/s "
          f"(after the first batch {row['steady_images_per_s']:7.1f}; first batch "
          f"{row['first_batch_s']:.2f} s)",
          flush=True,
        )
    num_images = {s: len(ImageNetLoader(root, s, batch_size=1)) for s in ("train", "val")}
  result = {
    "date": pages.utc_now(),
    "machine": cpu_description(),
    "command": cli.command_line("bench_imagenet_loader", argv),
    "num_images": num_images,
    "folder_mb": round(size_mb, 1),
    "generate_s": round(generate_s, 1),
    "batch_size": args.batch_size,
    "image_size": args.image_size,
    # The CPU may be shared: the 1-minute load average says how much of it others were using.
    "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    "rows": rows,
  }
  out = pages.output_dir("benchmarks", args.publish) / f"{NAME}.md"
  _write(out, result)
  print(f"wrote {out}")
  return result


def _write(path: Path, result: dict) -> None:
  lines = [
    "# ImageNet loader throughput (CPU)",
    "",
    f"- Command: `{result['command']}`",
    f"- Date: {result['date']}",
    f"- Machine: {result['machine']}",
    f"- 1-minute load average at start / end: {result['load_average'][0]} / "
    f"{result['load_average'][1]} (other jobs share this CPU; every rate below is slowed by "
    "about that load over the core count).",
    f"- Data: {result['num_images']['train']:,} train / {result['num_images']['val']:,} val "
    f"generated JPEGs ({result['folder_mb']} MB, about 500 x 375, quality 90) in the ImageNet "
    "folder layout.",
    f"- One epoch per row, batch {result['batch_size']}, output "
    f"{result['image_size']} x {result['image_size']} float32 normalised. `train`: random "
    "resized crop + flip; `val`: resize + centre crop. `workers` = grain worker processes "
    "(0: decoded in the consuming process). The first batch includes starting the workers "
    "(spawned processes that import grain, and JAX with it).",
    "",
    "| split | workers | images/s (epoch) | images/s (after the first batch) | first batch (s) |",
    "|---|---:|---:|---:|---:|",
  ]
  for row in result["rows"]:
    lines.append(
      f"| {row['split']} | {row['workers']} | {row['images_per_s']:.1f} "
      f"| {row['steady_images_per_s']:.1f} | {row['first_batch_s']:.2f} |"
    )
  best = {}
  for row in result["rows"]:
    if row["images_per_s"] > best.get(row["split"], {"images_per_s": -1})["images_per_s"]:
      best[row["split"]] = row
  lines += [
    "",
    "Fastest over the epoch: "
    + "; ".join(f"{split}: {row['workers']} worker(s)" for split, row in best.items())
    + ". A worker process pays only when a core is free for it; each one also costs its start "
    "(the first batch) once per epoch, and one copy of every batch between processes.",
  ]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(lines) + "\n")
  path.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  main(sys.argv[1:])

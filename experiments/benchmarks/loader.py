"""Loader throughput on CIFAR-10: images/second for each augmentation preset.

Measures only the data pipeline (gather, augment, normalise to float32, with background
prefetch threads); the consumer does nothing with the batches. Training step rates go beside it.

    python -m experiments.run bench_loader [--decode] [--epochs 1] [--batch-sizes 128,512]
    python -m experiments.benchmarks.loader ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from experiments.common import cli, pages
from experiments.common.machine import cpu_description
from jaxprune import data

PRESETS = ("none", "prunetrain", "sdgp", "clicktrain-mixup")


def _throughput(loader: data.Loader, epochs: int) -> tuple[float, float, float]:
  """Images per wall-clock second and per CPU second (all threads) over ``epochs`` full
  epochs, and seconds to the first batch. CPU time is what other jobs on a shared machine
  cannot inflate."""
  start, cpu_start = time.perf_counter(), time.process_time()
  first = None
  images = 0
  for _ in range(epochs):
    for x, _labels in loader:
      if first is None:
        first = time.perf_counter() - start
      images += x.shape[0]
  wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
  return images / wall, images / max(cpu, 1e-9), first or 0.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench_loader", description=__doc__.splitlines()[0])
  parser.add_argument(
    "--root", default=None, help="CIFAR-10 source (default: the shared data folder)"
  )
  parser.add_argument(
    "--cache-dir", default=None, help="decode cache (default $JAXPRUNE_CACHE or ~/.cache/jaxprune)"
  )
  parser.add_argument(
    "--decode", action="store_true", help="also time a from-scratch decode into a temporary cache"
  )
  parser.add_argument("--epochs", type=int, default=1, help="epochs timed per configuration")
  parser.add_argument("--batch-sizes", default="128,512")
  parser.add_argument("--threads", default="1,2", help="worker thread counts to try")
  parser.add_argument("--presets", default=",".join(PRESETS))
  parser.add_argument("--out", default=None, help="the page (default: loader_throughput.md)")
  cli.add_publish_argument(parser, "benchmarks/")
  args = parser.parse_args(argv)
  if args.out is None:
    args.out = str(pages.output_dir("benchmarks", args.publish) / "loader_throughput.md")
  if args.epochs < 1:
    parser.error("--epochs must be at least 1")
  return args


def main(argv: list[str] | None = None) -> dict:
  args = _parse(argv)
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  threads = [int(t) for t in args.threads.split(",")]
  presets = args.presets.split(",")

  load_before = os.getloadavg()[0]
  timings: dict[str, float] = {}
  if args.decode:
    with tempfile.TemporaryDirectory() as scratch:
      start, cpu_start = time.perf_counter(), time.process_time()
      data.load("cifar10", root=args.root, cache_dir=scratch)
      timings["decode_and_cache_s"] = time.perf_counter() - start
      timings["decode_and_cache_cpu_s"] = time.process_time() - cpu_start
  data.load("cifar10", root=args.root, cache_dir=args.cache_dir)  # make sure the cache exists
  start = time.perf_counter()
  train = data.load("cifar10", root=args.root, cache_dir=args.cache_dir)
  timings["load_from_cache_s"] = time.perf_counter() - start

  rows = []
  for preset in presets:
    for batch_size in batch_sizes:
      for num_threads in threads:
        loader = data.Loader(
          train, batch_size, augment=preset, seed=0, num_threads=num_threads, prefetch=2
        )
        rate, per_cpu, first = _throughput(loader, args.epochs)
        rows.append(dict(preset=preset, batch_size=batch_size, threads=num_threads, images_per_s=rate,
                                 images_per_cpu_s=per_cpu, first_batch_s=first))  # fmt: skip
        print(
          f"{preset:>17} batch {batch_size:4d} threads {num_threads}: {rate:9.0f} img/s, {per_cpu:9.0f} img/CPU-s",
          flush=True,
        )
      # The same work without threads: the pipeline's own cost per image.
      loader = data.Loader(train, batch_size, augment=preset, seed=0, prefetch=0)
      rate, per_cpu, first = _throughput(loader, args.epochs)
      rows.append(dict(preset=preset, batch_size=batch_size, threads=0, images_per_s=rate,
                             images_per_cpu_s=per_cpu, first_batch_s=first))  # fmt: skip
      print(
        f"{preset:>17} batch {batch_size:4d} no prefetch: {rate:9.0f} img/s, {per_cpu:9.0f} img/CPU-s",
        flush=True,
      )

  command = cli.command_line("bench_loader", argv)
  result = dict(
    date=pages.utc_now(),
    machine=cpu_description(),
    command=command.strip(),
    epochs=args.epochs,
    num_images=len(train),
    # The CPU may be shared: the 1-minute load average says how much of it others were using.
    load_average=[round(load_before, 2), round(os.getloadavg()[0], 2)],
    timings=timings,
    rows=rows,
  )
  _write(Path(args.out), result)
  return result


def _write(path: Path, result: dict) -> None:
  lines = [
    f"# Loader throughput (CIFAR-10 train, {result['num_images']:,} images)",
    "",
    f"- Command: `{result['command']}`",
    f"- Date: {result['date']}",
    f"- Machine: {result['machine']}",
    f"- 1-minute load average at start / end: {result['load_average'][0]} / {result['load_average'][1]}"
    " (other jobs sharing the CPU slow every number below by about that factor over the core count).",
    f"- Each configuration runs {result['epochs']} full epoch(s) (drop_last, shuffled); the consumer does no work.",
    "  `threads` = worker threads with prefetch 2; `0` = built synchronously in the consuming thread.",
    "- Output per batch: float32 NHWC normalised images, int32 labels (soft float32 labels with mixup).",
    "",
  ]
  timings = result["timings"]
  if "decode_and_cache_s" in timings:
    lines.append(
      f"- Decoding the JPEG tarball and writing the cache (once): {timings['decode_and_cache_s']:.1f} s wall, "
      f"{timings['decode_and_cache_cpu_s']:.1f} s CPU."
    )
  lines += [f"- Loading the train split from the cache: {timings['load_from_cache_s']:.2f} s.", ""]
  lines += [
    "`images/CPU-s` divides by the CPU time of all the process's threads: the cost of the pipeline,",
    "which other jobs on a shared machine do not inflate (wall-clock `images/s` they do).",
    "",
    "| preset | batch | threads | images/s | images/CPU-s | first batch (ms) |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for row in result["rows"]:
    lines.append(
      f"| {row['preset']} | {row['batch_size']} | {row['threads']} | {row['images_per_s']:,.0f} "
      f"| {row['images_per_cpu_s']:,.0f} | {row['first_batch_s'] * 1e3:.1f} |"
    )
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(lines) + "\n")
  path.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
  main(sys.argv[1:])

"""CIFAR-10 JPEG decoding on a cold cache: seconds with one process and with one per core.

Each row reads the JPEG tarball into an empty cache folder with
``jaxprune.data.cifar.read_cifar10(..., processes=P)``, as the first ``data.load("cifar10")``
on a bare machine does: read and decompress the archive, list it, decode train and test, write
the cache. Wall and CPU seconds (this process and its finished worker processes) of each,
best of ``--repeats`` by wall; the decoding's own wall seconds as the decoder logs them.

    python -m experiments.run bench_decode [--processes 1,0] [--repeats 2] [--publish]

Writes ``runs/benchmarks/decode_cpu.md`` (scratch, git-ignored) unless ``--publish`` (then
``experiments/results/benchmarks/``).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from experiments.common import cli, pages
from experiments.common.machine import cpu_description
from jaxprune import data
from jaxprune.data.cifar import read_cifar10

NAME = "decode_cpu"
_DECODER_LOG = "jaxprune.data._decode"
# Cores of the GPU hosts the estimate on the page is for.
_HOST_CORES = 16


class _DecodeLog(logging.Handler):
  """What the decoder logs of each call ("decoded %d images in %.1f s (%d processes)"):
  images and wall seconds summed, the most processes used."""

  def __init__(self):
    super().__init__(logging.INFO)
    self.images = self.processes = 0
    self.seconds = 0.0

  def emit(self, record: logging.LogRecord) -> None:
    images, seconds, processes = record.args
    self.images += images
    self.seconds += seconds
    self.processes = max(self.processes, processes)


def _cpu_seconds() -> tuple[float, float]:
  """CPU seconds of this process, and of its children that have exited (the decoders)."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _cold_read(path: Path, processes: int | None) -> dict[str, float]:
  logger = logging.getLogger(_DECODER_LOG)
  log, level = _DecodeLog(), logger.level
  logger.addHandler(log)
  logger.setLevel(logging.INFO)
  try:
    with tempfile.TemporaryDirectory() as cache:
      start, (own_start, children_start) = time.perf_counter(), _cpu_seconds()
      splits = read_cifar10(path, Path(cache), processes=processes)
      wall, (own, children) = time.perf_counter() - start, _cpu_seconds()
  finally:
    logger.removeHandler(log)
    logger.setLevel(level)
  images = len(splits.train_labels) + len(splits.test_labels)
  if log.images != images:
    raise RuntimeError(f"{path} was not decoded ({log.images} of {images} images)")
  own, children = own - own_start, children - children_start
  return {
    "processes": log.processes,
    "wall_s": round(wall, 2),
    "cpu_s": round(own + children, 2),
    "cpu_reader_s": round(own, 2),
    "cpu_workers_s": round(children, 2),
    "decode_wall_s": round(log.seconds, 2),
    "images": images,
  }


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench_decode", description=__doc__.splitlines()[0])
  parser.add_argument(
    "--root",
    default=None,
    help="the CIFAR-10 JPEG tarball or folder (default: cifar10-jpeg.tar.gz in the data folder)",
  )
  parser.add_argument(
    "--processes",
    default="1,0",
    help="decoding process counts to time (0: the default, one per core)",
  )
  parser.add_argument("--repeats", type=int, default=2, help="cold reads per count (best kept)")
  cli.add_publish_argument(parser, "benchmarks/")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error("--repeats must be at least 1")
  try:
    args.processes = [int(p) for p in args.processes.split(",")]
  except ValueError:
    parser.error(f"--processes must be comma-separated ints, got {args.processes!r}")
  if min(args.processes) < 0:
    parser.error("--processes must be >= 0")
  args.root = Path(args.root) if args.root else data.default_data_dir() / "cifar10-jpeg.tar.gz"
  if not args.root.exists():
    parser.error(f"no CIFAR-10 JPEG data at {args.root}: pass --root")
  return args


def main(argv: list[str] | None = None) -> dict:
  args = _parse(argv)
  load_before = os.getloadavg()[0]
  rows = []
  for count in args.processes:
    runs = [_cold_read(args.root, count or None) for _ in range(args.repeats)]
    best = min(runs, key=lambda run: run["wall_s"])
    rows.append({**best, "runs": runs})
    print(
      f"processes {best['processes']:2d}: cold read {best['wall_s']:.1f} s wall, {best['cpu_s']:.1f} s "
      f"CPU; decoding {best['decode_wall_s']:.1f} s wall",
      flush=True,
    )
  result = {
    "date": pages.utc_now(),
    "machine": cpu_description(),
    "command": cli.command_line("bench_decode", argv),
    "source": args.root.name,
    "source_mb": round(args.root.stat().st_size / 1e6, 1) if args.root.is_file() else None,
    "repeats": args.repeats,
    # The CPU may be shared: the 1-minute load average says how much of it others were using.
    "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    "cores": os.cpu_count(),
    "rows": rows,
  }
  stem = pages.output_dir("benchmarks", args.publish) / NAME
  pages.write_result(stem, result, _page(result))
  print(f"wrote {stem}.md")
  return result


def _estimate(rows: list[dict]) -> str | None:
  """The page's estimate for a many-core host, from the most parallel row."""
  parallel = max(rows, key=lambda r: r["processes"])
  serial = next((r for r in rows if r["processes"] == 1), None)
  if serial is None or parallel["processes"] < 2:
    return None
  # The reading process's work (the archive, dispatching chunks, the cache) stays serial; the
  # workers' CPU (decoding, their start, the transfers) spreads over the cores.
  reader, workers = parallel["cpu_reader_s"], parallel["cpu_workers_s"]
  estimate = reader + workers / _HOST_CORES
  return (
    f"**Estimate for a {_HOST_CORES}-core host (not measured):** with cores as fast as these "
    f"and none busy with other work, the reading process's {reader:.1f} CPU seconds stay "
    f"serial and the workers' {workers:.1f} spread over {_HOST_CORES} processes: a cold read "
    f"of about {reader:.1f} + {workers:.1f} / {_HOST_CORES} = {estimate:.1f} s, against "
    f"{serial['cpu_s']:.1f} s with one process (its CPU seconds here). Reading, decompressing "
    "and listing the archive then take most of it."
  )


def _page(result: dict) -> str:
  lines = [
    "# CIFAR-10 JPEG decoding, cold cache (CPU)",
    "",
    f"- Command: `{result['command']}`",
    f"- Date: {result['date']}",
    f"- Machine: {result['machine']}",
    f"- 1-minute load average at start / end: {result['load_average'][0]} / "
    f"{result['load_average'][1]} (other jobs share this CPU; wall seconds grow by about that "
    "load over the core count, CPU seconds much less).",
    f"- Source: `{result['source']}`"
    + (f" ({result['source_mb']} MB)" if result["source_mb"] else "")
    + f", {result['rows'][0]['images']:,} 32x32 JPEGs (train and test).",
    "- Each row: `read_cifar10(root, <empty cache>, processes=P)`, as the first "
    '`data.load("cifar10")` on a bare machine: read and decompress the archive, list it, decode '
    f"both splits, write the cache. Best of {result['repeats']} by wall. `P = 1` decodes in the "
    "reading process (the serial decoder); more start that many worker processes (fresh "
    "interpreters importing NumPy and Pillow only), fed chunks of JPEG bytes through pipes.",
    "- CPU: this process (the reader) and its worker processes. Decoding: wall seconds of the "
    "two decode calls (train, test) as the decoder logs them; `processes` as it logs them too "
    "(the test split's 10,000 images may get fewer).",
    "",
    "| processes | cold read wall (s) | cold read CPU (s) | of which reader / workers (s) "
    "| decoding wall (s) |",
    "|---:|---:|---:|---:|---:|",
  ]
  for row in result["rows"]:
    lines.append(
      f"| {row['processes']} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} "
      f"| {row['cpu_reader_s']:.1f} / {row['cpu_workers_s']:.1f} | {row['decode_wall_s']:.1f} |"
    )
  if min(result["load_average"]) > result.get("cores", 0):
    lines += [
      "",
      "Other jobs kept more processes running than there are cores throughout: the decoding "
      "processes then share the CPU time the others leave, whatever their number, and the wall "
      "columns cannot show what parallel decoding gains; the CPU columns, and the estimate "
      "below built from them, can.",
    ]
  estimate = _estimate(result["rows"])
  if estimate:
    lines += ["", estimate]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main(sys.argv[1:])

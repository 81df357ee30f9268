"""Spend one accelerator command on the next paper-budget rows not yet published.

    python -m experiments.run gpu_queue --max-seconds 520 --out /tmp/queue --bundle OUT/queue.tar.gz
    python -m experiments.run gpu_queue --dry-run            # the plan and its estimates
    python -m experiments.run gpu_queue --publish queue.tar.gz   # back on the CPU machine

The queue (:data:`QUEUE`) lists every paper-budget training in a fixed priority order:
ClickTrain VGG-11 dense, ClickTrain VGG-11, SDGP Table I (dense, mvue, magnitude, rescaled,
random), PruneTrain VGG-11 (dense and PruneTrain), ClickTrain VGG-11 aligned G = 1 and G = 16,
then the rest. A row already published in
``experiments/results/<paper>/`` is skipped. A row starts only when its time model says it
ends inside what is left of ``--max-seconds``: its steps × its step time, plus its compile,
evaluation and per-epoch costs. The step times are accelerator measurements (:data:`QUEUE`);
each finished row measures its own step time, and the ratio to
its prior scales the priors of the rows after it. Every row also runs with ``--must-finish``:
after its first epoch the trainer's own estimate stops it if it cannot end in the box.

Each finished row's JSON, per-epoch log and plots land under ``--out/<paper>/`` as the table
command writes them, and ``--bundle`` (a ``.tar.gz``) is rewritten after every row with
everything but checkpoints, plus the device report (``device_report.md`` / ``.json``: device,
JAX version, decode seconds, and per row the wall, compile and step times, data wait and
evaluation cost). ``--publish BUNDLE`` merges the returned rows into
``experiments/results/<paper>/`` and rewrites the ``table1_paper`` pages beside the papers'
numbers, with the date and device each row was trained on.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import shutil
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from experiments.common import cli, pages, run_options

# One evaluation of the 10k test set at batch 500 (the SDGP rows evaluate twice per image for
# the flip TTA), and the per-epoch host work besides the steps (metrics, a compression read-out
# of the params, the hooks), on the device loader: H200, 2026-11-27 (gpu_queue_report.md:
# 0.02 s and about 0.01 s for VGG-11), with room to spare.
EVAL_S = 0.05
EPOCH_OVERHEAD_S = 0.05
DEFAULT_MAX_SECONDS = 520.0
# Seconds the command spends besides the rows: imports, the first CIFAR-10 decode (5.3 s on
# the H200 host), the bundle.
START_S = 20.0


@dataclasses.dataclass(frozen=True)
class Row:
  """One paper-budget training of the queue.

  Attributes:
    name: its name in the queue and the report.
    table: the table command (a module of ``experiments``) and ``argv`` its arguments besides
      ``--budget paper --out``.
    paper: the results folder it publishes to.
    result: what it writes there: a JSON file name, or ``(file, method)`` for a page whose JSON
      holds several rows (SDGP Table I).
    epochs, steps_per_epoch: its recipe's.
    step_ms: prior step time on an H100 (fp32), to be replaced by measurement.
    compile_s: prior compile seconds of its programs.
    evals: how often it evaluates at the accelerator default (every 10 epochs and the last).
    eval_factor: forward passes per evaluated image (2 with flip TTA).
  """

  name: str
  table: str
  argv: tuple[str, ...]
  paper: str
  result: str | tuple[str, str]
  epochs: int
  steps_per_epoch: int
  step_ms: float
  compile_s: float
  eval_factor: float = 1.0

  @property
  def evals(self) -> int:
    return self.epochs // 10 + (self.epochs % 10 != 0)

  def estimate_s(self, speed: float = 1.0) -> float:
    """Seconds from start to end on a device ``speed`` times slower than the priors' H100."""
    steps = self.epochs * self.steps_per_epoch * self.step_ms / 1000 * speed
    return (
      self.compile_s
      + steps
      + self.evals * EVAL_S * self.eval_factor * speed
      + self.epochs * EPOCH_OVERHEAD_S
    )

  def published(self, results: Path) -> bool:
    """Whether ``results/<paper>/`` already holds this row."""
    folder = results / self.paper
    if isinstance(self.result, str):
      return (folder / self.result).exists()
    return _saved_run(folder, self.result) is not None


def _saved_run(folder: Path, result: tuple[str, str]) -> dict[str, Any] | None:
  """The run of method ``result[1]`` in the page JSON ``folder / result[0]``: a ``rows`` list
  (SDGP Table I) or a ``runs`` mapping (a PruneTrain row); ``None`` when it is not there."""
  name, method = result
  path = folder / name
  if not path.exists():
    return None
  saved = json.loads(path.read_text())
  if "runs" in saved:
    return saved["runs"].get(method)
  return next((r for r in saved.get("rows", []) if r.get("method") == method), None)


def _clicktrain(name: str, row: str, method: str, step_ms: float, *extra: str) -> Row:
  label = method
  if "--filter-groups" in extra:
    label = f"aligned-g{extra[extra.index('--filter-groups') + 1]}"
  return Row(
    name=name,
    table="clicktrain_table1",
    argv=("--rows", row, "--methods", method, *extra),
    paper="clicktrain",
    result=f"table1_paper_{row}_{label}.json",
    epochs=190,
    steps_per_epoch=390,
    step_ms=step_ms,
    # ClickTrain's step holds the stage machine: ≈2.8× the dense step's compile on the CPU.
    compile_s=10.0 if method == "dense" else 25.0,
  )


def _sdgp(method: str, step_ms: float) -> Row:
  return Row(
    name=f"sdgp-table1-{method}",
    table="sdgp_table1",
    argv=("--rows", method),
    paper="sdgp",
    result=("table1_paper.json", method),
    epochs=150,
    steps_per_epoch=97,
    step_ms=step_ms,
    compile_s=8.0,
    eval_factor=2.0,
  )


# Step times (ms, fp32 with TF32 convolutions, batch 128 unless stated), measured on one H200
# through the device loader (2026-11-27, benchmarks/device_loader_*_gpu.md, 13 steps per call):
# ClickTrain VGG-11 dense 1.64, with ClickTrain 2.17 (at one step per call its stage machine
# made it 5.3); SDGP ResNet-9 dense at batch 512 about 19 (one step per call, the whole epoch of
# 97 steps per call now). The others are H100 measurements of the plain step (the 2:4 SDGP rows
# 1.05-1.10x of dense, VGG-13 scaled from VGG-11 by FLOPs, ResNet-32 10.1 / 11.2 ms) and scale
# with the rows measured in the same call.
QUEUE: tuple[Row, ...] = (
  _clicktrain("clicktrain-vgg11-dense", "vgg11", "dense", 1.64),
  _clicktrain("clicktrain-vgg11", "vgg11", "clicktrain", 2.17),
  _sdgp("dense", 19.0),
  _sdgp("mvue", 21.0),
  _sdgp("magnitude", 20.5),
  _sdgp("rescaled_magnitude", 20.5),
  _sdgp("random", 20.5),
  # Dense and PruneTrain in one command (the row's page holds both): 2 x 182 epochs; dense
  # VGG-11's step, and about 18 reconfigurations of a few compilations each.
  Row(
    name="prunetrain-vgg11",
    table="prunetrain_table1",
    argv=("--rows", "vgg11"),
    paper="prunetrain",
    result=("table1_paper_vgg11.json", "prunetrain"),
    epochs=364,
    steps_per_epoch=390,
    step_ms=1.64,
    compile_s=200.0,
  ),
  _clicktrain("clicktrain-vgg11-aligned-g1", "vgg11", "clicktrain", 2.17, "--filter-groups", "1"),
  _clicktrain("clicktrain-vgg11-aligned-g16", "vgg11", "clicktrain", 2.17, "--filter-groups", "16"),
  _clicktrain("clicktrain-vgg13-dense", "vgg13", "dense", 2.4),
  _clicktrain("clicktrain-vgg13", "vgg13", "clicktrain", 3.2),
  _clicktrain("clicktrain-resnet32-dense", "resnet32", "dense", 10.1),
  _clicktrain("clicktrain-resnet32", "resnet32", "clicktrain", 11.2),
)


def plan(
  rows: Sequence[Row], results: Path, seconds: float, speed: float = 1.0
) -> list[tuple[Row, str, float]]:
  """``(row, decision, estimate)`` for every row in order: ``"published"``, ``"run"`` (fits
  what is left after the rows before it) or ``"too long"``."""
  left, out = seconds - START_S, []
  for row in rows:
    estimate = row.estimate_s(speed)
    if row.published(results):
      out.append((row, "published", estimate))
    elif estimate <= left:
      out.append((row, "run", estimate))
      left -= estimate
    else:
      out.append((row, "too long", estimate))
  return out


def _measured(history: list[dict[str, Any]], steps_per_epoch: int) -> dict[str, float]:
  """Compile, step and evaluation seconds read off a run's per-epoch records: the first
  epoch's excess over the median epoch is its compile time (records without ``steps`` have
  the recipe's ``steps_per_epoch``)."""
  times = sorted(r["epoch_time_s"] for r in history)
  median = times[len(times) // 2]
  steps = history[0].get("steps", steps_per_epoch)
  evals = [r["eval_time_s"] for r in history if "eval_time_s" in r]
  return {
    "step_ms": 1000 * median / steps,
    "compile_s": max(0.0, history[0]["epoch_time_s"] - median),
    "eval_s": sorted(evals)[len(evals) // 2] if evals else 0.0,
    "data_wait_s_per_epoch": sum(r.get("data_wait_s", 0.0) for r in history) / len(history),
    "epochs": len(history),
  }


def _history(out: Path, row: Row) -> list[dict[str, Any]] | None:
  """The finished row's per-epoch records, read from what its table command wrote."""
  folder = out / row.paper
  if isinstance(row.result, str):
    path = folder / row.result
    return json.loads(path.read_text())["history"] if path.exists() else None
  run = _saved_run(folder, row.result)
  return run["history"] if run else None


def _bundle(out: Path, bundle: Path | None) -> None:
  """``bundle``: a tar.gz of ``out`` without checkpoints, written whole and then renamed, so a
  command cut short leaves the last complete one."""
  if bundle is None:
    return
  bundle.parent.mkdir(parents=True, exist_ok=True)
  partial = bundle.with_name(bundle.name + ".partial")
  with tarfile.open(partial, "w:gz") as tar:
    for path in sorted(out.rglob("*")):
      if path.is_file() and "checkpoints" not in path.relative_to(out).parts:
        tar.add(path, arcname=str(path.relative_to(out)))
  partial.replace(bundle)


def _device() -> dict[str, Any]:
  import jax

  from experiments.common.machine import machine_description

  return {
    "machine": machine_description(),
    "backend": jax.default_backend(),
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
  }


def _report_page(report: dict[str, Any]) -> str:
  lines = [
    "# gpu_queue device report",
    "",
    f"- Command: `{report['command']}`",
    f"- Date: {report['date']}",
    f"- Machine: {report['device']['machine']}",
    f"- CIFAR-10 decode (first load on this machine): {report['decode_s']:.1f} s",
    f"- Time box: {report['max_seconds']:.0f} s; used {report['elapsed_s']:.0f} s",
    "",
    (
      "| row | status | estimate (s) | wall (s) | step (ms, median epoch) | compile (s) | eval (s) "
      "| data wait / epoch (s) | test acc |"
    ),
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in report["rows"]:
    m = r.get("measured", {})

    def cell(key, fmt, m=m):
      return fmt.format(m[key]) if key in m else "—"

    acc = f"{100 * r['test_acc']:.2f}%" if r.get("test_acc") is not None else "—"
    lines.append(
      f"| {r['name']} | {r['status']} | {r['estimate_s']:.0f} | "
      + (f"{r['wall_s']:.0f}" if "wall_s" in r else "—")
      + f" | {cell('step_ms', '{:.2f}')} | {cell('compile_s', '{:.1f}')} | "
      f"{cell('eval_s', '{:.2f}')} | {cell('data_wait_s_per_epoch', '{:.3f}')} | {acc} |"
    )
  errors = [r for r in report["rows"] if r.get("error")]
  for r in errors:
    lines += ["", f"## {r['name']}: error", "", "```", r["error"].rstrip(), "```"]
  return "\n".join(lines) + "\n"


def _write_report(out: Path, report: dict[str, Any]) -> None:
  (out / "device_report.json").write_text(json.dumps(report, indent=1))
  (out / "device_report.md").write_text(_report_page(report))


def run_queue(
  args: argparse.Namespace, command: str, tables: Callable[[str], Callable] | None = None
) -> dict[str, Any]:
  """Trains the planned rows one after another (see the module docstring); returns the
  report. ``tables(name)`` gives a table command's ``main`` (default: the experiment)."""
  from experiments import run as experiments_run
  from jaxprune import data

  tables = tables or experiments_run.load
  start = time.perf_counter()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  bundle = Path(args.bundle) if args.bundle else None
  t0 = time.perf_counter()
  for split in ("train", "test"):  # decoded once; the table commands then read the cache
    data.load("cifar10", root=args.root, split=split)
  report: dict[str, Any] = {
    "command": command,
    "date": pages.utc_now(),
    "device": _device(),
    "decode_s": time.perf_counter() - t0,
    "max_seconds": args.max_seconds,
    "rows": [],
  }
  speed = 1.0  # measured step time over the priors', from the rows finished so far
  for row in _selected(args.only):
    left = args.max_seconds - (time.perf_counter() - start)
    entry: dict[str, Any] = {"name": row.name, "estimate_s": row.estimate_s(speed)}
    report["rows"].append(entry)
    if row.published(pages.RESULTS):
      entry["status"] = "published"
      continue
    if entry["estimate_s"] > left - 5.0:  # 5 s for the bundle and the report
      entry["status"] = f"too long ({left:.0f} s left)"
      continue
    argv = [*row.argv, "--budget", "paper", "--out", str(out / row.paper), "--dtype", args.dtype]
    argv += ["--max-seconds", f"{left - 5.0:.0f}", "--must-finish", "--loader", args.loader]
    if args.root:
      argv += ["--root", args.root]
    print(
      f"[gpu_queue] {row.name}: estimate {entry['estimate_s']:.0f} s, {left:.0f} s left", flush=True
    )
    t1 = time.perf_counter()
    try:
      result = tables(row.table)(argv)
      entry["status"] = "stopped" if "stopped" in result else "done"
    except Exception:  # noqa: BLE001 (one row's failure must not lose the rows already trained)
      entry["status"] = "error"
      entry["error"] = traceback.format_exc()
      print(entry["error"], flush=True)
    entry["wall_s"] = time.perf_counter() - t1
    _bundle(out, bundle)  # the row's files first: a failure below must not lose them
    try:
      history = _history(out, row) if entry["status"] == "done" else None
      if history:
        entry["measured"] = _measured(history, row.steps_per_epoch)
        entry["test_acc"] = history[-1].get("test_acc")
        speed = entry["measured"]["step_ms"] / row.step_ms
    except Exception:  # noqa: BLE001 (a read-out of the report; the row itself is saved)
      entry["report_error"] = traceback.format_exc()
    report["elapsed_s"] = time.perf_counter() - start
    _write_report(out, report)
    _bundle(out, bundle)
  report["elapsed_s"] = time.perf_counter() - start
  _write_report(out, report)
  _bundle(out, bundle)
  return report


def _selected(only: str | None) -> tuple[Row, ...]:
  if not only:
    return QUEUE
  names = [n.strip() for n in only.split(",") if n.strip()]
  known = {row.name: row for row in QUEUE}
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"--only: unknown rows {unknown}; choose from {list(known)}")
  return tuple(known[n] for n in names)


def publish(bundle: Path, results: Path = pages.RESULTS) -> list[str]:
  """Merges the rows of a returned bundle (or folder) into ``results`` and rewrites the paper
  pages they belong to; returns the files written. The device report goes to
  ``results/benchmarks/gpu_queue_report.md``."""
  with tempfile.TemporaryDirectory() as tmp:
    source = Path(bundle)
    if source.is_file():
      with tarfile.open(source) as tar:
        tar.extractall(tmp, filter="data")
      source = Path(tmp)
    written = []
    for paper, publisher in _PUBLISHERS.items():
      folder = source / paper
      if folder.is_dir():
        (results / paper).mkdir(parents=True, exist_ok=True)
        written += publisher(folder, results / paper)
    report = source / "device_report.md"
    if report.exists():
      target = results / "benchmarks" / "gpu_queue_report.md"
      shutil.copyfile(report, target)
      shutil.copyfile(source / "device_report.json", target.with_suffix(".json"))
      written.append(str(target))
  return written


def _copy_paper_files(source: Path, target: Path, pattern: str) -> list[str]:
  written = []
  for path in sorted(source.glob(pattern)):
    if "checkpoints" in path.relative_to(source).parts:
      continue
    dest = target / path.relative_to(source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, dest)
    written.append(str(dest))
  return written


def _publish_clicktrain(source: Path, target: Path) -> list[str]:
  from experiments.clicktrain import table1 as clicktrain_table1

  written = _copy_paper_files(source, target, "table1_paper_*")
  # The logs of the rows returned (not those of runs stopped at the box, which return none).
  for run in source.glob("table1_paper_*.json"):
    log = json.loads(run.read_text()).get("log")
    if log and (source / log).exists():
      written += _copy_paper_files(source, target, log)
  written.append(str(clicktrain_table1.write_pages(target, "paper")))
  return written


def _publish_sdgp(source: Path, target: Path) -> list[str]:
  from experiments.sdgp import table1 as sdgp_table1

  written = _copy_paper_files(source, target, "logs/table1_paper_*")
  returned = json.loads((source / "table1_paper.json").read_text())
  written.append(str(sdgp_table1.merge_rows(target / "table1_paper", returned)))
  return written


def _publish_prunetrain(source: Path, target: Path) -> list[str]:
  from experiments.prunetrain import table1 as prunetrain_table1

  written = _copy_paper_files(source, target, "table1_paper_*")
  written += _copy_paper_files(source, target, "logs/table1_paper_*")
  written.append(str(prunetrain_table1.write_table_page(target, "paper", "-")))
  return written


_PUBLISHERS = {
  "clicktrain": _publish_clicktrain,
  "sdgp": _publish_sdgp,
  "prunetrain": _publish_prunetrain,
}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="gpu_queue", description=__doc__.splitlines()[0])
  p.add_argument("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS, help="time box")
  p.add_argument("--out", default=None, help="where rows are written (default runs/gpu_queue)")
  p.add_argument("--bundle", default=None, help="a .tar.gz of --out rewritten after each row")
  p.add_argument("--only", default=None, help="comma list of queue rows to consider, in order")
  p.add_argument("--dtype", choices=list(cli.DTYPES), default="fp32")
  p.add_argument("--root", default=None, help="CIFAR-10 source (default: data package's)")
  p.add_argument(
    "--loader",
    choices=run_options.LOADERS,
    default="auto",
    help="the table commands' --loader (auto: the device loader on an accelerator)",
  )
  p.add_argument("--dry-run", action="store_true", help="print the plan with its estimates")
  p.add_argument("--publish", default=None, help="merge a returned bundle into the results")
  args = p.parse_args(argv)
  if args.max_seconds <= 0:
    p.error(f"--max-seconds must be positive, got {args.max_seconds}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  if args.publish:
    written = publish(Path(args.publish))
    print("\n".join(written))
    return {"published": written}
  if args.dry_run:
    rows = plan(_selected(args.only), pages.RESULTS, args.max_seconds)
    buf = io.StringIO()
    buf.write(f"plan for {args.max_seconds:.0f} s (priors: accelerator step times, fp32):\n")
    for row, decision, estimate in rows:
      buf.write(f"  {row.name:32s} {estimate:7.0f} s  {decision}\n")
    print(buf.getvalue(), end="", flush=True)
    return {"plan": [(r.name, d, e) for r, d, e in rows]}
  args.out = args.out or str(pages.SCRATCH / "gpu_queue")
  # The bundle goes to wherever the machine returns files from; the report names only the file.
  shown = list(argv) if argv is not None else sys.argv[1:]
  if args.bundle and "--bundle" in shown:
    shown[shown.index("--bundle") + 1] = Path(args.bundle).name
  return run_queue(args, cli.command_line("gpu_queue", shown))


if __name__ == "__main__":
  main()

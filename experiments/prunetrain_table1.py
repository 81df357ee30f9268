"""PruneTrain Table 1 (CIFAR-10): dense vs PruneTrain, accuracy and training / inference cost.

Paper recipe (PruneTrain §5 and the authors' scripts): batch 128, SGD momentum 0.9, lr 0.1 ×0.1 at epochs
91 and 136, weight decay 5e-4, 182 epochs, group-lasso penalty ratio 0.2, reconfiguration
every 10 epochs, dynamic mini-batch (+32 while the step's memory fits the first step's,
LR scaled linearly).  Both runs use the same data, schedule and number of epochs.

``--budget paper`` is that recipe; ``--budget cpu`` (the default) the reduced one every row
shares (``experiments/_tables.py``): half width over the full training set, 10 epochs at batch
128 (3 900 steps), LR drops at 50% / 75%, reconfiguration every epoch, penalty ratio 0.55 and
threshold 1e-2.  Why: with SGD the group lasso shrinks a group's norm by about
lr·λ/(1−momentum) per step; with the paper's ratio 0.2 (λ ≈ 2e-4 for ResNet-32) that is
~1e-4 per step, so the ~1.4-norm groups of a fresh ResNet-32 need ~10⁴ steps to die, while
the budget affords ~4·10³; the groups then jitter around zero with amplitude ~lr·λ, above the
paper's 1e-4, hence the larger threshold.  Earlier probes (10 240 images × 8 epochs at lr
0.05, 1 280 steps, full width; summarised in ``results/prunetrain/index.md``): ratios 0.5 and
0.7 removed nothing, 0.78 removed 34% of the inference FLOPs for −3.3 points, 0.85 removed
62–68% for −22 to −30 points; the cpu budget has about 6× their shrinkage (lr × steps), so
0.6 sits between "nothing" and "too much".  At this budget 0.6 (λ ≈ 2.4e-3 for ResNet-32) ended
at 13% of the inference FLOPs, well past the paper's 34%; most channels died in epochs 3–5, before
the first LR drop, so the budget uses 0.55 (λ 0.8× that, each group's shrinkage 1.25× slower).

    python -m experiments.run prunetrain_table1 --budget paper --rows resnet32   # GPU
    python -m experiments.run prunetrain_table1 --budget cpu --rows resnet32     # ~1 h, 2 cores

Each row writes ``table1_<budget>_<row>.{md,json}`` (the per-epoch channels / FLOPs table
and the plot ``table1_<budget>_<row>_over_training.png``) and its runs' epoch logs
(``logs/``); the table page ``table1_<budget>.md`` gathers every row present in the folder
beside the paper's Table 1.  All go to ``runs/prunetrain/``, or to
``experiments/results/prunetrain/`` with ``--publish``.  A row too long for one sitting runs
in parts: each run checkpoints after every epoch (``runs/checkpoints/``) and the same command
with ``--resume`` continues it exactly (a row whose dense run is already saved goes on with
``--skip-dense --reuse-dense --resume``).

``--proximal`` applies the group lasso as a proximal step (``with_group_lasso(...,
proximal=True)``: groups reach exact zero, so the paper's 1e-4 threshold applies);
``--channel-multiple k`` rounds the kept widths up to multiples of k.  At this budget the
proximal form did not give a better trade-off: ratio 0.99 (λ ≈ 0.076, the proximal step is
not amplified by momentum) removed channels from epoch 2 on but held the network at
13–25% (a probe summarised in ``results/prunetrain/index.md``).

``--min-flops-saving f`` installs a reconfiguration only when it saves at least ``f`` of the
inference FLOPs (``PruneTrainCallback(min_flops_saving=f)``): on the CPU every installed one
costs 10–12 s between epochs (the pruning, the cost accounting and one compilation of the
step to probe the dynamic mini-batch) plus the recompilation of the step in the next epoch
(measured in a paired probe), together about 25 ResNet-32 steps.  Each
run's training CPU seconds and the host's steal time are recorded beside the wall time: on a
shared virtual machine steal time stretches wall time (by 2× in some epochs of earlier runs)
without changing the work.

``--paired`` trains dense and PruneTrain in one process, alternating epochs, for the
wall-time comparison. Run back to back, the two rows saw different host loads: two identical
dense runs, ``_milestones`` and ``_milestones_skip5``, trained in 1310 s and 840 s, far more
than the saving being measured. Alternating, both see the same drift; the paired run
computes exactly what the two separate runs compute (tested).

"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flax import nnx

from experiments import _tables
from experiments._machine import host_steal_seconds, machine_description, steal_since
from jaxprune import data, methods, models, train
from jaxprune import prunetrain as pt

# PruneTrain Table 1, CIFAR-10: accuracy change vs dense, training FLOPs and inference FLOPs
# of the final model as a fraction of the dense baseline (training time in brackets).
PAPER = {
  "prunetrain-resnet32": {
    "acc_delta": -1.8,
    "train_flops": 0.47,
    "train_time": 0.81,
    "inference_flops": 0.34,
  },
  "prunetrain-resnet50": {
    "acc_delta": -1.1,
    "train_flops": 0.50,
    "train_time": 0.81,
    "inference_flops": 0.30,
  },
  "prunetrain-vgg11": {
    "acc_delta": -0.7,
    "train_flops": 0.43,
    "train_time": 0.57,
    "inference_flops": 0.35,
  },
  "prunetrain-vgg13": {
    "acc_delta": -0.6,
    "train_flops": 0.44,
    "train_time": 0.57,
    "inference_flops": 0.37,
  },
}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="prunetrain_table1", description=__doc__.splitlines()[0])
  _tables.add_table_arguments(parser, "prunetrain_table1")
  _tables.add_resume_argument(parser)
  parser.add_argument(
    "--rows",
    default="resnet32",
    help=f"comma list of {','.join(ROWS)} (every row trains with the same budget)",
  )
  parser.add_argument(
    "--proximal",
    action="store_true",
    help="apply the group lasso as a proximal step (exact zeros; not the paper's)",
  )
  parser.add_argument(
    "--channel-multiple", type=int, default=1, help="round kept widths up to this multiple"
  )
  parser.add_argument("--no-dynamic-batch", action="store_true")
  parser.add_argument(
    "--min-flops-saving",
    type=float,
    default=0.0,
    help="install a reconfiguration only when it saves at least this fraction of the "
    "inference FLOPs (each one recompiles the step); 0 = the paper's behaviour",
  )
  parser.add_argument(
    "--recompute-batchnorm",
    type=int,
    default=0,
    metavar="N",
    help="re-estimate BatchNorm statistics from N training batches before each evaluation and "
    "after each installed reconfiguration (PruneTrainCallback); 0 = off, the paper's behaviour",
  )
  parser.add_argument("--skip-dense", action="store_true", help="run PruneTrain only")
  parser.add_argument(
    "--reuse-dense",
    nargs="?",
    const="",
    default=None,
    metavar="JSON",
    help="with --skip-dense: keep the dense row of an earlier run's JSON (same model / data / "
    "schedule; default: this run's name without --name-suffix) instead of dropping it",
  )
  parser.add_argument(
    "--paired",
    action="store_true",
    help="train dense and PruneTrain in one process, alternating epochs, so that both see "
    "the same host load (the wall-time comparison of a shared machine)",
  )
  parser.add_argument(
    "--name-suffix", default="", help="appended to the row's file names (probes, not rows)"
  )
  args = parser.parse_args(argv)
  rows = [r for r in args.rows.split(",") if r]
  unknown = sorted(set(rows) - set(ROWS))
  if unknown or not rows:
    parser.error(f"--rows: unknown {unknown}; choose from {ROWS}")
  args.rows = rows
  args.model = f"prunetrain-{rows[0]}"  # main sets each row's in turn
  # The budget's settings become attributes, as recorded in each row's JSON.
  for key, value in _tables.get_budget("prunetrain_table1", args.budget).items():
    setattr(args, key, list(value) if isinstance(value, tuple) else value)
  args.weight_decay = 5e-4
  if args.reuse_dense is not None and not args.skip_dense:
    parser.error("--reuse-dense needs --skip-dense (otherwise the dense row is run)")
  if args.paired and args.skip_dense:
    parser.error("--paired trains the dense row beside PruneTrain: drop --skip-dense")
  return args


ROWS = tuple(name.split("-", 1)[1] for name in PAPER)
# Settings that make a dense row reusable: the dense run does not depend on the others.
_DENSE_SETTINGS = (
  "model",
  "width",
  "train_subset",
  "test_subset",
  "epochs",
  "batch_size",
  "lr",
  "milestones",
  "weight_decay",
  "seed",
)


def _reused_dense_run(
  args: argparse.Namespace, name: str, folder: Path | None = None
) -> dict[str, Any] | None:
  """The dense run of ``--reuse-dense``'s JSON (None without the flag).

  Raises:
    ValueError: that JSON was run with other dense settings (:data:`_DENSE_SETTINGS`).
  """
  if args.reuse_dense is None:
    return None
  if args.reuse_dense:
    previous = Path(args.reuse_dense)
  else:
    base = name[: -len(args.name_suffix)] if args.name_suffix else name
    previous = (
      (folder or _tables.output_dir("prunetrain", args.publish, args.out)) / base
    ).with_suffix(".json")
  earlier = json.loads(previous.read_text())
  different = [k for k in _DENSE_SETTINGS if earlier["args"].get(k) != getattr(args, k)]
  if different:
    raise ValueError(f"--reuse-dense: {previous} was run with other {', '.join(different)}")
  return earlier["runs"]["dense"]


@dataclasses.dataclass
class _Run:
  """One method's training, advanced epoch by epoch (so two can alternate, ``--paired``)."""

  method: str
  trainer: train.Trainer
  train_loader: data.Loader
  test_loader: data.Loader
  callback: pt.PruneTrainCallback | None
  dense_costs: dict[str, Any]
  image_shape: tuple[int, ...]
  wall_s: float = 0.0
  steal_s: float | None = 0.0

  def advance(self, epochs: int) -> None:
    """Train until ``epochs`` epochs are complete, adding the wall and steal time taken."""
    if self.trainer.epoch >= epochs:  # resumed past it (``--paired``: the other run stopped first)
      return
    steal_start = host_steal_seconds()
    start = time.perf_counter()
    self.trainer.fit(
      self.train_loader, self.test_loader, epochs=epochs, resume=False, overwrite=True
    )
    self.wall_s += time.perf_counter() - start
    steal = steal_since(steal_start)
    self.steal_s = None if steal is None or self.steal_s is None else self.steal_s + steal


class _RunningStatsEval(train.Callback):
  """Test accuracy with the BatchNorm running statistics as training left them, recorded
  before ``PruneTrainCallback(recompute_batchnorm=N)`` re-estimates them (it must come
  first among the callbacks).

  Training reads batch statistics only, so re-estimation changes evaluation and nothing
  else: one run gives the accuracy without it (``test_acc_running_stats``) and with it
  (the trainer's ``test_acc``) at every epoch. A run without re-estimation would carry the
  same running statistics: BatchNorm's momentum 0.9 forgets a reset within an epoch's
  hundreds of steps.
  """

  def __init__(self, test_loader: data.Loader):
    self.test_loader = test_loader
    self._acc: float | None = None

  def on_train_epoch_end(self, trainer: train.Trainer, epoch: int, train_loader) -> None:
    self._acc = trainer.evaluate(self.test_loader)["test_acc"]

  def on_epoch_end(self, trainer: train.Trainer, epoch: int) -> dict[str, Any]:
    acc, self._acc = self._acc, None
    return {"test_acc_running_stats": acc}


def _build(
  args: argparse.Namespace,
  method: str,
  train_set,
  test_set,
  log_dir: Path,
  checkpoint_dir: Path | None = None,
) -> _Run:
  """One method's run, restored from ``checkpoint_dir`` under ``--resume``."""
  train_loader = data.Loader(
    train_set, args.batch_size, shuffle=True, seed=args.seed, augment="prunetrain", drop_last=True
  )
  test_loader = data.Loader(test_set, min(500, len(test_set)), shuffle=False, drop_last=False)
  steps_per_epoch = len(train_loader)
  # The paper's LR drops at epochs 91 and 136 of 182 (50% and 75%).
  milestones = sorted({max(1, round(f * args.epochs)) for f in args.milestones})
  milestones = [m for m in milestones if m < args.epochs]
  schedule = train.step_schedule(args.lr, steps_per_epoch, milestones) if milestones else args.lr
  tx = train.sgd(schedule, momentum=0.9, weight_decay=args.weight_decay)
  model = models.create(
    args.model,
    num_classes=train_set.num_classes,
    rngs=nnx.Rngs(args.seed),
    width_multiplier=args.width,
  )
  image_shape = tuple(train_set.images.shape[1:])
  config = {}
  if method == "prunetrain":
    config = {
      "penalty_ratio": args.penalty_ratio,
      "proximal": args.proximal,
      "every_epochs": args.interval,
      "threshold": args.threshold,
      "channel_multiple": args.channel_multiple,
      "dynamic_batch": not args.no_dynamic_batch,
      "max_batch_size": len(train_set),
      "min_flops_saving": args.min_flops_saving,
      "recompute_batchnorm": args.recompute_batchnorm,
    }
  run = methods.Run.from_loader(train_loader, epochs=args.epochs)
  chosen = methods.get(method, **config)
  callbacks = chosen.callbacks(run)
  callback = callbacks[0] if callbacks else None
  if callback is not None and args.recompute_batchnorm:
    callbacks = [_RunningStatsEval(test_loader), *callbacks]
  dense_costs = pt.model_costs(model, image_shape)
  trainer = train.Trainer(
    model,
    chosen.make_tx(tx, run),
    callbacks=callbacks,
    progress=False,
    log_path=log_dir / f"{method}.jsonl",
    checkpoint_dir=checkpoint_dir,
    # A resume under other settings is refused, not mixed in.
    run_config={
      "method": method,
      **{k: getattr(args, k) for k in _DENSE_SETTINGS},
      **config,
    },
  )
  built = _Run(method, trainer, train_loader, test_loader, callback, dense_costs, image_shape)
  if checkpoint_dir is not None and _tables.start_or_resume(trainer, train_loader, args.resume):
    # Wall time of the earlier parts as the trainer kept it; their steal time is unknown.
    built.wall_s, built.steal_s = trainer.history[-1]["wall_time_s"], None
  return built


def _train_paired(runs: Sequence[_Run], epochs: int) -> None:
  """Alternate the runs epoch by epoch, the order swapped every epoch (ABBA...).

  Both then train under the same host load: on a shared machine the load drifts over
  minutes, so back-to-back runs (~15 min each at the reduced budget) can differ by more than
  the saving being measured.
  """
  for epoch in range(1, epochs + 1):
    for run in runs if epoch % 2 else reversed(runs):
      run.advance(epoch)


def _result(args: argparse.Namespace, run: _Run) -> dict[str, Any]:
  trainer, callback, history = run.trainer, run.callback, run.trainer.history
  final_model, final_layers_removed = trainer.model, 0
  if callback is not None:
    # The inference model: whatever is dead at the end goes, also channels whose removal a
    # reconfiguration skipped (--min-flops-saving) or that died after the last one.
    final_model, _, final_report = pt.reconfigure(
      trainer.model,
      None,
      threshold=args.threshold,
      input_shape=(1, *run.image_shape),
      channel_multiple=args.channel_multiple,
    )
    final_layers_removed = len(final_report.removed_layers)
  final_costs = pt.model_costs(final_model, run.image_shape)
  dense_costs = run.dense_costs
  train_time = sum(r["epoch_time_s"] for r in history)
  eval_time = sum(r.get("eval_time_s", 0.0) for r in history)
  result = {
    "method": run.method,
    "test_acc": history[-1]["test_acc"],
    "best_test_acc": max(r["test_acc"] for r in history),
    "wall_time_s": run.wall_s,
    "train_time_s": train_time,
    # between epochs, outside evaluation: reconfigurations, batch-growth probes, logging
    "between_epochs_s": run.wall_s - train_time - eval_time,
    # process CPU seconds of the training epochs: the work, whatever the host's steal time
    "train_cpu_time_s": sum(r["cpu_time_s"] for r in history),
    "host_steal_s": run.steal_s,
    "inference_flops": final_costs["inference_flops"],
    "inference_flops_ratio": final_costs["inference_flops"] / dense_costs["inference_flops"],
    "params": final_costs["params"],
    "params_ratio": final_costs["params"] / dense_costs["params"],
    "final_spec": repr(final_model.spec),
    # JSON form, so benchmarks can rebuild the final model (prunetrain_speed --run)
    "final_spec_json": train.encode_spec(final_model.spec),
    "history": history,
  }
  if callback is not None:
    last = history[-1]
    result.update(
      {
        "train_flops_ratio": last["pt_train_flops_ratio"],
        "allreduce_ratio": last["pt_allreduce_ratio"],
        "bn_bytes": last["pt_bn_bytes"],
        # installed reconfigurations only (a skipped one's report lists layers it kept)
        "layers_removed": sum(r.get("pt_layers_removed", 0) for r in history)
        + final_layers_removed,
        "batch_sizes": [r["batch_size"] for r in history],
        "lambda": float(trainer.opt_state.group_lasso.coefficient),
      }
    )
    dense_bn = dense_costs["bn_bytes"] * sum(r["steps"] * r["batch_size"] for r in history)
    result["bn_bytes_ratio"] = last["pt_bn_bytes"] / dense_bn
  else:
    result["train_flops_ratio"] = 1.0
  return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  command = _tables.command_line("prunetrain_table1", argv)
  folder = _tables.output_dir("prunetrain", args.publish, args.out)
  # A subset size of None means the full split.
  train_set = data.load("cifar10", root=args.root, split="train").balanced_subset(
    args.train_subset, args.seed
  )
  test_set = data.load("cifar10", root=args.root, split="test").balanced_subset(
    args.test_subset, args.seed + 1
  )
  out = {}
  for row in args.rows:
    args.model = f"prunetrain-{row}"
    out[row] = _run_row(
      args, f"table1_{args.budget}_{row}{args.name_suffix}", folder, command, train_set, test_set
    )
    if not args.name_suffix:  # a probe (named by its suffix) is not a row of the table
      write_table_page(folder, args.budget, command)
  return out


def _run_row(args, name, folder, command, train_set, test_set) -> dict[str, Any]:
  reused = _reused_dense_run(args, name, folder)
  log_dir = folder / "logs" / name
  log_dir.mkdir(parents=True, exist_ok=True)
  runs = {}
  if reused is not None:
    runs["dense"] = reused
  names = ["prunetrain"] if args.skip_dense else ["dense", "prunetrain"]
  print(
    f"[{name}] {', '.join(names)}{' (paired)' if args.paired else ''}: {len(train_set)} "
    f"train / {len(test_set)} test images, {args.epochs} epochs",
    flush=True,
  )
  if args.paired:
    paired = [
      _build(args, method, train_set, test_set, log_dir, _checkpoints(args, name, method))
      for method in names
    ]
    _train_paired(paired, args.epochs)
    for run in paired:
      runs[run.method] = _result(args, run)
    _write(folder / name, args, runs, command)
    for method in names:
      shutil.rmtree(_checkpoints(args, name, method), ignore_errors=True)
  for method in [] if args.paired else names:
    run = _build(args, method, train_set, test_set, log_dir, _checkpoints(args, name, method))
    run.advance(args.epochs)
    runs[method] = _result(args, run)
    _write(folder / name, args, runs, command)
    shutil.rmtree(_checkpoints(args, name, method), ignore_errors=True)  # saved: nothing to resume
  return runs


def _checkpoints(args: argparse.Namespace, name: str, method: str) -> Path:
  return _tables.checkpoint_dir("prunetrain", f"{name}/{method}", args.out)


def write_table_page(folder: Path, budget_name: str, command: str) -> Path:
  """``table1_<budget>.md``: every row of this budget in ``folder`` beside the paper's
  Table 1 (the rows' JSON files are the source, so rows run separately share one page, which
  names each row's command; ``command`` for a row saved without one)."""
  budget = _tables.as_saved(_tables.get_budget("prunetrain_table1", budget_name))
  rows, logs, shown = [], {}, []
  for row in ROWS:
    path = folder / f"table1_{budget_name}_{row}.json"
    if not path.exists():
      continue
    saved = json.loads(path.read_text())
    ran_with = {key: saved["args"].get(key) for key in budget}
    if ran_with != budget:
      # A row run before the budget changed would not compare with the others.
      different = sorted(k for k in budget if ran_with[k] != budget[k])
      warnings.warn(
        f"{path.name}: run with other budget settings ({', '.join(different)}); left off the "
        "table page until it is run again",
        RuntimeWarning,
        stacklevel=2,
      )
      continue
    shown.append(saved)
    paper, runs = saved["paper"], saved["runs"]
    dense, pruned = runs.get("dense"), runs.get("prunetrain")
    ours = [None, None, None, None]
    if pruned:
      delta = 100 * (pruned["test_acc"] - dense["test_acc"]) if dense else None
      ours = [
        f"{100 * dense['test_acc']:.2f}" if dense else None,
        None if delta is None else f"{delta:+.2f}",
        f"{100 * pruned['train_flops_ratio']:.0f}%",
        f"{100 * pruned['inference_flops_ratio']:.0f}%",
      ]
    label = f"[{row}]({path.stem}.md)"
    rows.append(
      (
        label,
        [
          None,
          f"{paper['acc_delta']:+.1f}",
          f"{100 * paper['train_flops']:.0f}%",
          f"{100 * paper['inference_flops']:.0f}%",
        ],
        ours,
      )
    )
    logs[label] = f"logs/{path.stem}/prunetrain.jsonl"
  page = _tables.results_page(
    "PruneTrain Table 1 — CIFAR-10, dense vs PruneTrain",
    command=_tables.joined_commands(shown, default=command),
    budget_name=budget_name,
    budget=_tables.get_budget("prunetrain_table1", budget_name),
    machine=machine_description(),
    columns=["dense acc (%)", "Δ acc (points)", "train FLOPs", "inference FLOPs"],
    rows=rows,
    logs=logs,
    notes=[
      (
        "FLOPs are PruneTrain's as a fraction of the dense run's (training: the whole run; "
        "inference: the final model). The paper's accuracy is after 182 epochs at full width."
      ),
      (
        "Each row links its page: per-epoch test accuracy, batch size, inference FLOPs, params "
        "and channels removed, and the channels / FLOPs-over-training plot."
      ),
    ],
  )
  out = folder / f"table1_{budget_name}.md"
  out.write_text(page)
  return out


def _named_runs(pt_run: dict[str, Any], dense: dict[str, Any] | None) -> list[tuple[str, Any]]:
  """``[("PruneTrain", pt_run), ("dense", dense)]``, without dense when it was not run."""
  return [(name, run) for name, run in (("PruneTrain", pt_run), ("dense", dense)) if run]


def _runs_row(
  title: str, named: Sequence[tuple[str, Any]], values: Sequence[float], suffix: str = ""
) -> str:
  """``| title PruneTrain / dense | a / b |``: one value (seconds) per run of ``named``."""
  label = " / ".join(name for name, _ in named)
  return f"| {title} {label} | {' / '.join(f'{v:.0f}' for v in values)}{suffix} |"


def _cpu_time_rows(pt_run: dict[str, Any], dense: dict[str, Any] | None) -> list[str]:
  """Table rows for the process CPU time and the host's steal time (runs that logged them)."""
  named = _named_runs(pt_run, dense)
  cpu = [run.get("train_cpu_time_s") for _, run in named]
  if None in cpu:
    return []
  rows = [_runs_row("train CPU time (s, process)", named, cpu)]
  steal = [run.get("host_steal_s") for _, run in named]
  if None not in steal:
    rows.append(_runs_row("host steal time during the run (CPU-s)", named, steal))
  return rows


def _between_epoch_rows(pt_run: dict[str, Any], dense: dict[str, Any] | None) -> list[str]:
  """Rows for the time between epochs (reconfigurations) and the training total (runs that
  logged it): what a reconfiguration costs is part of PruneTrain's wall time."""
  named = _named_runs(pt_run, dense)
  between = [run.get("between_epochs_s") for _, run in named]
  if None in between:
    return []
  totals = [run["train_time_s"] + b for (_, run), b in zip(named, between)]
  ratio = f" ({totals[0] / totals[1]:.3f}×)" if len(totals) == 2 else ""
  return [
    _runs_row("between epochs: reconfigurations, batch probes (s)", named, between),
    _runs_row("training wall time, epochs + between (s)", named, totals, ratio),
  ]


def _paired_epoch_rows(pt_run: dict[str, Any], dense: dict[str, Any]) -> list[str]:
  """Per-epoch times of a ``--paired`` run: each PruneTrain epoch beside the dense epoch
  trained next to it, with the inference FLOPs of the model that trained it."""
  lines = [
    (
      "| epoch | dense epoch (s) | PruneTrain epoch (s) | ratio | PruneTrain between (s) "
      "| FLOPs of the model trained | dense CPU (s) | PruneTrain CPU (s) |"
    ),
    "|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  dense_flops = pt_run["history"][0]["pt_inference_flops"]
  wall_before = 0.0
  for d, p in zip(dense["history"], pt_run["history"]):
    between = p["wall_time_s"] - wall_before - p["epoch_time_s"] - p.get("eval_time_s", 0.0)
    wall_before = p["wall_time_s"]
    lines.append(
      f"| {p['epoch']} | {d['epoch_time_s']:.1f} | {p['epoch_time_s']:.1f} "
      f"| {p['epoch_time_s'] / d['epoch_time_s']:.3f} | {between:.1f} "
      f"| {p['pt_inference_flops'] / dense_flops:.3f} | {d['cpu_time_s']:.0f} "
      f"| {p['cpu_time_s']:.0f} |"
    )
  return lines


def _write(stem: Path, args: argparse.Namespace, runs: dict[str, Any], command: str) -> None:
  date = _tables.utc_now()
  machine = machine_description()
  stem.with_suffix(".json").write_text(
    json.dumps(
      {
        "args": vars(args),
        "command": command,
        "date": date,
        "paper": PAPER[args.model],
        "runs": runs,
      },
      indent=1,
      default=str,
    )
  )
  paper = PAPER[args.model]
  pt_run, dense = runs.get("prunetrain"), runs.get("dense")
  lines = [
    f"# PruneTrain Table 1, CIFAR-10 {args.model}, budget `{args.budget}`",
    "",
    f"- Command: `{command}`",
    f"- Date: {date}; machine: {machine}",
    (
      f"- Data: {args.train_subset or 50000} training / {args.test_subset or 10000} test images "
      f"of the JPEG-re-encoded CIFAR-10; pad-4 crop + flip; model width ×{args.width:g}."
    ),
    f"- Recipe: batch {args.batch_size}, SGD momentum 0.9, lr {args.lr} (×0.1 at "
    f"{', '.join(f'{100 * f:.0f}%' for f in args.milestones)} of {args.epochs} epochs), "
    f"wd {args.weight_decay}; PruneTrain: penalty ratio "
    f"{args.penalty_ratio}"
    + (" applied as a proximal step (exact zeros; not the paper's)" if args.proximal else "")
    + f", threshold {args.threshold}, reconfiguration every {args.interval} epoch(s)"
    + (f", widths rounded up to ×{args.channel_multiple}" if args.channel_multiple > 1 else "")
    + f", dynamic mini-batch {'off' if args.no_dynamic_batch else 'on (+32)'}"
    + (
      f", a reconfiguration installed only when it saves ≥ {100 * args.min_flops_saving:.0f}% "
      "of the inference FLOPs (not the paper's)"
      if args.min_flops_saving
      else ""
    )
    + (
      f", BatchNorm statistics re-estimated from {args.recompute_batchnorm} training batches "
      "before each evaluation and after each installed reconfiguration (not the paper's)"
      if args.recompute_batchnorm
      else ""
    )
    + ".",
  ]
  if args.budget != "paper":
    lines.append(
      "- Reduced budget: a few epochs cannot reach the paper's accuracy. "
      "The penalty ratio and threshold are raised so that channels die within the "
      "run (see the module docstring for the arithmetic). Compare the two "
      "measured rows with each other, not with the paper's numbers."
    )
  if args.paired:
    lines.append(
      "- Paired: dense and PruneTrain trained in one process, alternating epochs (the order "
      "swapped every epoch), so that both saw the same host load; each run's times count "
      "its own epochs only."
    )
  lines += [
    "",
    (
      "| | test acc | Δ acc vs dense | train FLOPs (vs dense) | inference FLOPs | "
      "params | layers removed |"
    ),
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  if dense:
    lines.append(
      f"| dense (measured) | {100 * dense['test_acc']:.2f}% | — | 100% | 100% "
      f"| {dense['params']:,.0f} | 0 |"
    )
  if pt_run:
    delta = f"{100 * (pt_run['test_acc'] - dense['test_acc']):+.2f}%" if dense else "—"
    lines.append(
      f"| PruneTrain (measured) | {100 * pt_run['test_acc']:.2f}% | {delta} "
      f"| {100 * pt_run['train_flops_ratio']:.0f}% | {100 * pt_run['inference_flops_ratio']:.0f}% "
      f"| {pt_run['params']:,.0f} ({100 * pt_run['params_ratio']:.0f}%) "
      f"| {pt_run['layers_removed']} |"
    )
  lines.append(
    f"| PruneTrain (paper, 182 epochs) | — | {paper['acc_delta']:+.1f}% "
    f"| {100 * paper['train_flops']:.0f}% (time {100 * paper['train_time']:.0f}%) "
    f"| {100 * paper['inference_flops']:.0f}% | — | — |"
  )
  if pt_run:
    named = _named_runs(pt_run, dense)
    lines += [
      "",
      "| PruneTrain extra | value |",
      "|---|---:|",
      f"| λ (set at step 1 from ratio {args.penalty_ratio}) | {pt_run['lambda']:.3g} |",
      f"| BatchNorm traffic vs dense | {100 * pt_run['bn_bytes_ratio']:.0f}% |",
      f"| ring all-reduce volume vs dense (4 devices) | {100 * pt_run['allreduce_ratio']:.0f}% |",
      f"| batch size per epoch | {pt_run['batch_sizes']} |",
      _runs_row("train time (s)", named, [run["train_time_s"] for _, run in named]),
      *_between_epoch_rows(pt_run, dense),
      *_cpu_time_rows(pt_run, dense),
      f"| final spec | `{pt_run['final_spec']}` |",
      "",
    ]
    stale = all(r.get("test_acc_running_stats") is not None for r in pt_run["history"])
    if stale:
      lines += [
        "BatchNorm re-estimation, before / after: `test acc` is evaluated after the running "
        "statistics were re-estimated, `running stats` with them as training left them "
        "(the same run, the same weights; see `_RunningStatsEval`).",
        "",
        "| epoch | test acc | running stats | batch | inference MFLOPs | params | channels removed |",
        "|---:|---:|---:|---:|---:|---:|---:|",
      ]
    else:
      lines += [
        "| epoch | test acc | batch | inference MFLOPs | params | channels removed |",
        "|---:|---:|---:|---:|---:|---:|",
      ]
    for r in pt_run["history"]:
      before = f"| {100 * r['test_acc_running_stats']:.2f}% " if stale else ""
      lines.append(
        f"| {r['epoch']} | {100 * r['test_acc']:.2f}% {before}| {r['batch_size']} "
        f"| {r.get('pt_inference_flops_after', r['pt_inference_flops']) / 1e6:.1f} "
        f"| {r.get('pt_params_after', r['pt_params']):,.0f} "
        f"| {r.get('pt_channels_removed', 0)} |"
      )
    if args.paired and dense:
      lines += ["", *_paired_epoch_rows(pt_run, dense)]
    plot = _plot_over_training(pt_run, stem)
    if plot is not None:
      lines += ["", f"![channels and FLOPs over training]({plot.name})"]
  lines += [
    "",
    "Per-epoch logs: "
    + ", ".join(f"[{m}](logs/{stem.name}/{m}.jsonl)" for m in runs if m in ("dense", "prunetrain")),
  ]
  stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _plot_over_training(pt_run: dict[str, Any], stem: Path) -> Path | None:
  """PruneTrain's figure: the model's inference FLOPs and parameters, and the channels
  removed, after each epoch (relative to the dense model); None without matplotlib."""
  try:
    import matplotlib
  except ImportError:
    return None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  history = pt_run["history"]
  epochs = [r["epoch"] for r in history]
  flops0, params0 = history[0]["pt_inference_flops"], history[0]["pt_params"]
  flops = [r.get("pt_inference_flops_after", r["pt_inference_flops"]) / flops0 for r in history]
  params = [r.get("pt_params_after", r["pt_params"]) / params0 for r in history]
  removed, total = [], 0
  for r in history:
    total += r.get("pt_channels_removed", 0)
    removed.append(total)
  fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3))
  left.plot(epochs, flops, marker="o", label="inference FLOPs")
  left.plot(epochs, params, marker="s", label="parameters")
  left.set_xlabel("epoch")
  left.set_ylabel("fraction of dense")
  left.set_ylim(0, 1.05)
  left.legend(fontsize=8)
  right.step(epochs, removed, where="post", color="tab:red")
  right.set_xlabel("epoch")
  right.set_ylabel("channels removed (cumulative)")
  fig.suptitle(f"PruneTrain over training: {stem.name}", fontsize=9)
  fig.tight_layout()
  out = stem.parent / f"{stem.name}_over_training.png"
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


if __name__ == "__main__":
  main()

"""PruneTrain Table 1 (CIFAR-10): dense vs PruneTrain, accuracy and training / inference cost.

Paper recipe (PruneTrain §5 and the authors' scripts): batch 128, SGD momentum 0.9, lr 0.1 ×0.1 at epochs
91 and 136, weight decay 5e-4, 182 epochs, group-lasso penalty ratio 0.2, reconfiguration
every 10 epochs, dynamic mini-batch (+32 while the step's memory fits the first step's,
LR scaled linearly).  Both runs use the same data, schedule and number of epochs.

``--budget paper`` is that recipe; ``--budget cpu`` (the default) the reduced one every row
shares (``experiments/common/budgets.py``): half width over the full training set, 10 epochs at batch
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
(``logs/table1_<budget>_<row>_<method>.jsonl``); the table page ``table1_<budget>.md``
gathers every row present in the folder beside the paper's Table 1.  All go to
``runs/prunetrain/``, or to ``experiments/results/prunetrain/`` with ``--publish``; a probe
(``--name-suffix``) to ``probes/`` there.  ``--dtype bf16`` trains the models in bfloat16
(parameters float32) and names its files with the budget ``<budget>_bf16``
(``table1_cpu_bf16_resnet32.json``, page ``table1_cpu_bf16.md``), apart from the fp32 rows.
A row too long for one sitting runs in parts: each run checkpoints after every epoch
(``runs/checkpoints/``) and the same command with ``--resume`` continues it exactly (a row
whose dense run is already saved goes on with ``--skip-dense --reuse-dense --resume``).

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

``--penalty-ratio r`` runs the budget at another ratio, a probe named ``_r<r>``; at ``fit``
the paper's 0.2 removes nothing in 1 920 steps and 0.9 (the same total shrinkage as the paper's
71 000 steps) keeps the network from learning (``results/prunetrain/index.md``).
``--page-only`` rewrites the rows' pages and the table page from their JSON (each row keeps its
command, date and machine).

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flax import nnx

from experiments.common import budgets, cli, pages, rows, run_options
from experiments.prunetrain import table1_pages
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
  cli.add_table_arguments(parser, "prunetrain_table1")
  cli.add_resume_argument(parser)
  cli.add_dtype_argument(parser)
  parser.add_argument(
    "--rows",
    default="resnet32",
    help=f"comma list of {','.join(ROWS)} (every row trains with the same budget)",
  )
  parser.add_argument(
    "--family",
    choices=FAMILIES,
    default="prunetrain",
    help="the networks: PruneTrain's own, or ClickTrain's of the same names (ClickTrain "
    "Table 1's PruneTrain rows; rows named clicktrain-<row>, their dense runs shared with "
    "clicktrain_table1's)",
  )
  parser.add_argument(
    "--width",
    dest="sweep_width",
    type=float,
    default=None,
    help="every row at this width multiplier instead of the budget's: a width sweep's probe, "
    "named with _w<W> (under probes/)",
  )
  parser.add_argument(
    "--proximal",
    action="store_true",
    help="apply the group lasso as a proximal step (exact zeros; not the paper's)",
  )
  parser.add_argument(
    "--channel-multiple", type=int, default=1, help="round kept widths up to this multiple"
  )
  parser.add_argument(
    "--no-dynamic-batch",
    action="store_true",
    help="keep the batch size after a reconfiguration (no PruneTrain §4.3 mini-batch growth)",
  )
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
    "--penalty-ratio",
    dest="probe_penalty_ratio",
    type=float,
    default=None,
    help="PruneTrain's penalty ratio instead of the budget's: a probe, named _r<R> (under probes/)",
  )
  parser.add_argument(
    "--page-only",
    action="store_true",
    help="rewrite the rows' pages and the table page from their saved JSON; train nothing",
  )
  parser.add_argument(
    "--name-suffix",
    default="",
    help="appended to the row's file names: a probe, not a row, written to probes/",
  )
  run_options.add_arguments(parser)
  args = parser.parse_args(argv)
  chosen = [r for r in args.rows.split(",") if r]
  unknown = sorted(set(chosen) - set(ROWS))
  if unknown or not chosen:
    parser.error(f"--rows: unknown {unknown}; choose from {ROWS}")
  args.rows = chosen
  if args.sweep_width is not None:  # a width sweep's run is a probe beside the table
    args.name_suffix = f"_w{args.sweep_width:g}{args.name_suffix}"
  if args.probe_penalty_ratio is not None:  # so is a run at another penalty ratio
    if not 0.0 < args.probe_penalty_ratio < 1.0:
      parser.error(f"--penalty-ratio must be in (0, 1), got {args.probe_penalty_ratio}")
    args.name_suffix = f"_r{args.probe_penalty_ratio:g}{args.name_suffix}"
  if args.reuse_dense is not None and not args.skip_dense:
    parser.error("--reuse-dense needs --skip-dense (otherwise the dense row is run)")
  if args.paired and args.skip_dense:
    parser.error("--paired trains the dense row beside PruneTrain: drop --skip-dense")
  if args.paired and args.max_seconds is not None:
    parser.error("--max-seconds stops one run at a time: not with --paired")
  args = run_options.table_args(args, "prunetrain_table1")
  if args.probe_penalty_ratio is not None:
    args.recipe = dataclasses.replace(args.recipe, penalty_ratio=args.probe_penalty_ratio)
  return args


ROWS = tuple(name.split("-", 1)[1] for name in PAPER)
# The model families a row can train: PruneTrain's networks, or ClickTrain's of the same names
# (ClickTrain Table 1 has a PruneTrain row per network, -2.1 points at 2.2x on ResNet-32).
FAMILIES = ("prunetrain", "clicktrain")
# ClickTrain Table 1's PruneTrain rows: accuracy change (points) and compression.
CLICKTRAIN_PAPER = {
  "clicktrain-resnet32": {"acc_delta": -2.1, "compression": 2.2},
  "clicktrain-resnet50": {"acc_delta": -1.1, "compression": 2.2},
  "clicktrain-vgg11": {"acc_delta": -0.7, "compression": 6.6},
  "clicktrain-vgg13": {"acc_delta": -0.6, "compression": 6.3},
}
# Every run's SGD weight decay (the paper's).
WEIGHT_DECAY = 5e-4
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


def saved_args(args: argparse.Namespace, row: str) -> argparse.Namespace:
  """The settings of ``row``'s runs as one flat namespace: the command's flags, the resolved run
  options, the budget's settings, the model and the weight decay. A row's JSON saves it as its
  ``args`` (:func:`experiments.prunetrain.table1_pages.row_page`), which ``--reuse-dense`` and
  the table page compare."""
  flags = {k: v for k, v in vars(args).items() if k not in ("recipe", "options")}
  model = f"{getattr(args, 'family', 'prunetrain')}-{row}"
  return argparse.Namespace(
    **flags,
    **args.options.as_flags(),
    **budgets.as_saved(args.recipe),
    model=model,
    row_width=(
      budgets.row_width(args.recipe.width, model)
      if getattr(args, "sweep_width", None) is None
      else args.sweep_width
    ),
    weight_decay=WEIGHT_DECAY,
  )


def _reused_dense_run(
  saved: argparse.Namespace, name: str, folder: Path | None = None
) -> dict[str, Any] | None:
  """The dense run of ``--reuse-dense``'s JSON (None without the flag), for the row whose
  settings are ``saved`` (:func:`saved_args`).

  Raises:
    ValueError: that JSON was run with other dense settings (:data:`_DENSE_SETTINGS`) or
      another ``--dtype``.
  """
  if saved.reuse_dense is None:
    return None
  if saved.reuse_dense:
    previous = Path(saved.reuse_dense)
  else:
    base = name[: -len(saved.name_suffix)] if saved.name_suffix else name
    previous = (folder or pages.output_dir("prunetrain", saved.publish, saved.out)) / (
      f"{base}.json"
    )
  earlier = json.loads(previous.read_text())
  different = [k for k in _DENSE_SETTINGS if earlier["args"].get(k) != getattr(saved, k)]
  # A run saved before --dtype existed trained in fp32.
  if earlier["args"].get("dtype", "fp32") != saved.dtype:
    different.append("dtype")
  if different:
    raise ValueError(f"--reuse-dense: {previous} was run with other {', '.join(different)}")
  return earlier["runs"]["dense"]


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


def _spec(
  args: argparse.Namespace,
  row: str,
  method: str,
  train_set,
  test_set,
  log_stem: Path,
  checkpoint_dir: Path | None = None,
) -> rows.RowSpec:
  """One method's run of ``row`` as a row spec, logging each epoch to
  ``<log_stem>_<method>.jsonl``, checkpointing to ``checkpoint_dir``."""
  budget = args.recipe
  # The paper's LR drops at epochs 91 and 136 of 182 (50% and 75%).
  milestones = sorted({max(1, round(f * budget.epochs)) for f in budget.milestones})
  milestones = [m for m in milestones if m < budget.epochs]

  def optimizer(steps_per_epoch: int):
    lr = budget.lr
    schedule = train.step_schedule(lr, steps_per_epoch, milestones) if milestones else lr
    return train.sgd(schedule, momentum=0.9, weight_decay=WEIGHT_DECAY)

  image_shape = tuple(train_set.images.shape[1:])
  config = {}
  if method == "prunetrain":
    config = {
      "penalty_ratio": budget.penalty_ratio,
      "proximal": args.proximal,
      "every_epochs": budget.interval,
      "threshold": budget.threshold,
      "channel_multiple": args.channel_multiple,
      "dynamic_batch": not args.no_dynamic_batch,
      "max_batch_size": len(train_set),
      "min_flops_saving": args.min_flops_saving,
      "recompute_batchnorm": args.recompute_batchnorm,
    }
  chosen = methods.get(method, **config)

  def callbacks(test_loader, run):
    made = list(chosen.callbacks(run))
    if made and args.recompute_batchnorm:
      return [_RunningStatsEval(test_loader), *made]
    return made

  saved = saved_args(args, row)
  overrides = budgets.model_overrides(args.budget, saved.model)
  shared = None
  if method == "dense":  # the model's baseline, shared with every table that trains it alike
    shared = rows.shared_dense_run(
      args.budget,
      saved.model,
      saved.row_width,
      budget,
      args.options,
      publish=args.publish,
      out=args.out,
      seed=args.seed,
      dtype=args.dtype,
      augment="prunetrain",
      weight_decay=WEIGHT_DECAY,
      model_overrides=overrides,
    )
  return rows.RowSpec(
    label=f"[{log_stem.name}] {method}",
    model=lambda: models.create(
      saved.model,
      num_classes=train_set.num_classes,
      rngs=nnx.Rngs(args.seed),
      width_multiplier=saved.row_width,
      dtype=cli.compute_dtype(args),
      **overrides,
    ),
    method=chosen,
    optimizer=optimizer,
    train_set=train_set,
    test_set=test_set,
    batch_size=budget.batch_size,
    augment="prunetrain",
    epochs=budget.epochs,
    seed=args.seed,
    result=lambda run: _result(args, run),
    callbacks=callbacks,
    log_path=Path(f"{log_stem}_{method}.jsonl"),
    checkpoint_dir=checkpoint_dir,
    # A resume under other settings is refused, not mixed in.
    run_config={
      "method": method,
      **{k: getattr(saved, k) for k in _DENSE_SETTINGS},
      "row_width": saved.row_width,
      **config,
      **cli.dtype_config(args),
      **run_options.run_config(args.options),
    },
    measure=lambda model: pt.model_costs(model, image_shape),
    shared=shared,
  )


def _train_paired(runs: Sequence[rows.Row], epochs: int) -> None:
  """Alternate the runs epoch by epoch, the order swapped every epoch (ABBA...).

  Both then train under the same host load: on a shared machine the load drifts over
  minutes, so back-to-back runs (~15 min each at the reduced budget) can differ by more than
  the saving being measured.
  """
  for epoch in range(1, epochs + 1):
    for run in runs if epoch % 2 else reversed(runs):
      run.advance(epoch)


def _result(args: argparse.Namespace, run: rows.Row) -> dict[str, Any]:
  """The record of a finished run: accuracy, time, the final model's costs beside the dense
  model's, and PruneTrain's savings (its loader and provenance are added by
  :func:`rows.row_record`)."""
  trainer, history = run.trainer, run.trainer.history
  callback = next((c for c in run.callbacks if isinstance(c, pt.PruneTrainCallback)), None)
  image_shape = tuple(run.spec.train_set.images.shape[1:])
  final_model, final_layers_removed = trainer.model, 0
  if callback is not None:
    # The inference model: whatever is dead at the end goes, also channels whose removal a
    # reconfiguration skipped (--min-flops-saving) or that died after the last one.
    final_model, _, final_report = pt.reconfigure(
      trainer.model,
      None,
      threshold=args.recipe.threshold,
      input_shape=(1, *image_shape),
      channel_multiple=args.channel_multiple,
    )
    final_layers_removed = len(final_report.removed_layers)
  final_costs = pt.model_costs(final_model, image_shape)
  dense_costs = run.measured
  train_time = sum(r["epoch_time_s"] for r in history)
  eval_time = sum(r.get("eval_time_s", 0.0) for r in history)
  result = {
    "method": run.method,
    "test_acc": history[-1]["test_acc"],
    "best_test_acc": max(r["test_acc"] for r in history if "test_acc" in r),
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
        "bn_bytes": last["pt_bn_bytes_total"],
        # installed reconfigurations only (a skipped one's report lists layers it kept)
        "layers_removed": sum(r.get("pt_layers_removed") or 0 for r in history)
        + final_layers_removed,
        "batch_sizes": [r["batch_size"] for r in history],
        "lambda": float(trainer.opt_state.group_lasso.coefficient),
      }
    )
    dense_bn = dense_costs["bn_bytes"] * sum(r["steps"] * r["batch_size"] for r in history)
    result["bn_bytes_ratio"] = last["pt_bn_bytes_total"] / dense_bn
  else:
    result["train_flops_ratio"] = 1.0
  return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  command = cli.command_line("prunetrain_table1", argv)
  folder = pages.output_dir("prunetrain", args.publish, args.out)
  if args.page_only:
    return _rewrite_pages(args, folder, command)
  # A subset size of None means the full split.
  train_set = data.load("cifar10", root=args.root, split="train").balanced_subset(
    args.recipe.train_subset, args.seed
  )
  test_set = data.load("cifar10", root=args.root, split="test").balanced_subset(
    args.recipe.test_subset, args.seed + 1
  )
  out = {}
  for row in args.rows:
    name = _row_name(args, row)
    out[row] = _run_row(args, row, name, folder, command, train_set, test_set)
    if "stopped" in out[row]:
      return {**out, "stopped": f"{row} {out[row]['stopped']}"}
    if not args.name_suffix:  # a probe (named by its suffix) is not a row of the table
      write_table_page(folder, args.budget, command, args.dtype)
  return out


def _row_name(args: argparse.Namespace, row: str) -> str:
  """The stem of ``row``'s files: ``table1_<budget>[_<dtype>]_[<family>-]<row><suffix>``."""
  label = row if args.family == "prunetrain" else f"{args.family}-{row}"
  return f"table1_{args.budget}{cli.dtype_suffix(args)}_{label}{args.name_suffix}"


def _rewrite_pages(args: argparse.Namespace, folder: Path, command: str) -> dict[str, Any]:
  """``--page-only``: each row's page from its saved JSON (its own command and date), then the
  table page; a row with no JSON is an error."""
  if args.name_suffix:
    folder = pages.probes_dir(folder)
  out = {}
  for row in args.rows:
    stem = folder / _row_name(args, row)
    path = folder / f"{stem.name}.json"
    if not path.exists():
      raise SystemExit(f"--page-only: no saved row at {path}")
    saved = json.loads(path.read_text())
    table1_pages.row_page(
      stem,
      argparse.Namespace(**saved["args"]),
      saved["runs"],
      saved["command"],
      saved["paper"],
      date=saved["date"],
    )
    out[row] = saved["runs"]
  if not args.name_suffix:
    write_table_page(folder, args.budget, command, args.dtype)
  return out


def write_table_page(folder: Path, budget_name: str, command: str, dtype: str = "fp32") -> Path:
  """``table1_<budget>.md`` in ``folder`` (``table1_<budget>_bf16.md`` for ``dtype`` bf16):
  every row of :data:`ROWS` saved there under the budget and dtype (PruneTrain's networks, then
  ClickTrain's), beside the paper's Table 1
  (:func:`experiments.prunetrain.table1_pages.table_page`)."""
  other = tuple(f"clicktrain-{row}" for row in ROWS)
  return table1_pages.table_page(folder, budget_name, command, (*ROWS, *other), dtype)


def _run_row(args, row, name, folder, command, train_set, test_set) -> dict[str, Any]:
  """Trains ``row``'s runs (dense unless ``--skip-dense``, then PruneTrain) and writes the row's
  page and JSON after each; ``{..., "stopped": method}`` if one stopped at the time box."""
  saved = saved_args(args, row)
  reused = _reused_dense_run(saved, name, folder)
  # A probe (named by its --name-suffix) is not a row of the table: its files go to probes/.
  folder = pages.probes_dir(folder) if args.name_suffix else folder
  log_stem = folder / "logs" / name
  log_stem.parent.mkdir(parents=True, exist_ok=True)
  runs = {}
  if reused is not None:
    runs["dense"] = reused
  names = ["prunetrain"] if args.skip_dense else ["dense", "prunetrain"]
  print(
    f"[{name}] {', '.join(names)}{' (paired)' if args.paired else ''}: {len(train_set)} "
    f"train / {len(test_set)} test images, {args.recipe.epochs} epochs",
    flush=True,
  )
  paper = {**PAPER, **CLICKTRAIN_PAPER}[saved.model]
  specs = {
    method: _spec(
      args, row, method, train_set, test_set, log_stem, _checkpoints(args, name, method)
    )
    for method in names
  }
  if args.paired:
    paired = [rows.build_row(spec, args.options) for spec in specs.values()]
    _train_paired(paired, args.recipe.epochs)
    for run in paired:
      runs[run.method] = rows.row_record(run, args.options)
    table1_pages.row_page(folder / name, saved, runs, command, paper)
    for spec in specs.values():
      shutil.rmtree(spec.checkpoint_dir, ignore_errors=True)
    return runs
  for method, spec in specs.items():

    def save(record: dict[str, Any], method: str = method) -> None:
      runs[method] = record
      table1_pages.row_page(folder / name, saved, runs, command, paper)

    if rows.run_row(dataclasses.replace(spec, save=save), args.options) is None:
      return {**runs, "stopped": method}  # the command ends here; the checkpoint stays
  return runs


def _checkpoints(args: argparse.Namespace, name: str, method: str) -> Path:
  return run_options.checkpoint_dir("prunetrain", f"{name}/{method}", args.out)


if __name__ == "__main__":
  main()

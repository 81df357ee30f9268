"""The `fit` budget's sizing: dense runs at other widths, subsets or lengths, and the page that
shows every dense run of that recipe with its fit figures and minutes.

The `fit` budget (``experiments/common/budgets.py``) trains the papers' own networks until the
dense network fits its training data, inside an hour on 2 CPU cores. Its width, training subset
and length were chosen from runs like these: each trains a dense network with the recipe the
ClickTrain and PruneTrain tables share at `fit` (SGD momentum 0.9, lr 0.1 ×0.1 at 50% / 75% of
the run, weight decay 5e-4, batch 128, pad-crop + flip, a balanced subset of the training
images, the whole test set) and saves it as a shared dense run
(:class:`experiments.common.rows.SharedRun`). A probe at exactly the budget's settings *is* the
tables' dense run, which they then take instead of training it again, and a table's dense run
is a row of this page.

    python -m experiments.run fit_sizing --model clicktrain-vgg11 --width 0.25 --publish
    python -m experiments.run fit_sizing --page-only --publish     # the page from saved runs

The page, ``experiments/results/fit_sizing.md`` (``runs/fit_sizing.md`` without
``--publish``), lists every dense run saved in the output folder's ``shared/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common import budgets, cli, pages, rows, run_options

# The table whose recipe a probe of each model family follows (its dense runs are the same).
TABLES = {"clicktrain": "clicktrain_table1", "prunetrain": "prunetrain_table1"}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="fit_sizing", description=__doc__.splitlines()[0])
  parser.add_argument(
    "--model", default="clicktrain-vgg11", help="a clicktrain-* or prunetrain-* model"
  )
  parser.add_argument("--width", type=float, default=None, help="default: the fit budget's")
  parser.add_argument(
    "--train-subset", type=int, default=None, help="training images (default: the fit budget's)"
  )
  parser.add_argument("--epochs", type=int, default=None, help="default: the fit budget's")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--root", default=None, help="data folder (default: $JAXPRUNE_DATA)")
  parser.add_argument("--page-only", action="store_true", help="rewrite the page; train nothing")
  cli.add_output_arguments(parser, "")
  run_options.add_arguments(parser)
  args = parser.parse_args(argv)
  family = args.model.partition("-")[0]
  if family not in TABLES:
    parser.error(f"--model: {args.model!r} is no clicktrain-* or prunetrain-* model")
  fit = budgets.get_budget(TABLES[family], "fit")
  args.recipe = dataclasses.replace(
    fit, train_subset=args.train_subset or fit.train_subset, epochs=args.epochs or fit.epochs
  )
  if args.width is None:
    args.width = budgets.row_width(fit.width, args.model)
  args.options = run_options.resolve(args, "fit")
  return args


def probe_spec(
  args: argparse.Namespace, train_set: Any, test_set: Any, command: str
) -> rows.RowSpec:
  """The dense run of ``args`` as a row spec whose record names ``command``, shared with the
  tables' dense runs (the same name and settings as theirs: a probe at the budget's settings is
  their run)."""
  from flax import nnx

  from jaxprune import methods, models, train

  budget, seed = args.recipe, args.seed
  overrides = budgets.model_overrides("fit", args.model)
  milestones = [max(1, round(f * budget.epochs)) for f in budget.milestones]
  shared = rows.shared_dense_run(
    "fit",
    args.model,
    args.width,
    budget,
    args.options,
    publish=args.publish,
    out=args.out,
    seed=seed,
    dtype="fp32",
    augment=args.model.partition("-")[0],
    model_overrides=overrides,
  )
  stem = f"fit_sizing_{args.model}_x{args.width:g}_n{budget.train_subset}_e{budget.epochs}"
  return rows.RowSpec(
    label=f"{args.model} x{args.width:g} dense",
    model=lambda: models.create(
      args.model, num_classes=10, rngs=nnx.Rngs(seed), width_multiplier=args.width, **overrides
    ),
    method=methods.get("dense"),
    optimizer=lambda steps: train.sgd(
      train.step_schedule(budget.lr, steps, milestones), momentum=0.9, weight_decay=5e-4
    ),
    train_set=train_set,
    test_set=test_set,
    batch_size=budget.batch_size,
    augment=args.model.partition("-")[0],
    epochs=budget.epochs,
    seed=seed,
    result=lambda row: {**_result(row), "command": command},
    log_path=pages.shared_dir(args.publish, args.out) / "logs" / f"{stem}.jsonl",
    checkpoint_dir=run_options.checkpoint_dir("benchmarks", stem, args.out),
    run_config=dict(shared.settings),
    shared=shared,
  )


def _result(row: rows.Row) -> dict[str, Any]:
  """A probe's record: its accuracy, its wall and steal time and its history (the fit figures
  and provenance are added by :func:`rows.row_record`)."""
  history = row.trainer.history
  return {
    "test_acc": history[-1]["test_acc"],
    "wall_time_s": row.wall_s,
    "host_steal_s": row.steal_s,
    "history": history,
  }


def _params(model: str, width: float) -> int:
  """``model``'s parameter count at ``width`` (the tables' overrides do not change it)."""
  import jax
  from flax import nnx

  from jaxprune import models

  built = models.create(model, num_classes=10, rngs=nnx.Rngs(0), width_multiplier=width)
  return sum(int(x.size) for x in jax.tree.leaves(nnx.state(built, nnx.Param)))


def _probe_command(settings: dict[str, Any]) -> str:
  """The ``fit_sizing`` command that trains the run of ``settings`` again (a table's dense run
  at the budget is the same run)."""
  flags = (
    f"--model {settings['model']} --width {settings['width']:g} "
    f"--train-subset {settings['train_subset']} --epochs {settings['epochs']} "
    f"--eval-every {settings['eval_every']}"
  )
  return f"python -m experiments.run fit_sizing {flags} --publish"


def sizing_page(shared: Path, title: str = "The `fit` budget: sizing") -> str:
  """The page of every dense run saved in ``shared``: model, width, parameters, data, steps,
  minutes, the fit figures, and whether it is a table's dense run at the `fit` budget."""
  runs = []
  for path in sorted(Path(shared).glob("*.json")):
    saved = json.loads(path.read_text())
    if "settings" in saved and "history" in saved:
      runs.append((path, saved))
  lines = [
    f"# {title}",
    "",
    (
      "Dense runs of the recipe the ClickTrain and PruneTrain tables share at the `fit` budget "
      "(SGD momentum 0.9, lr 0.1 ×0.1 at 50% / 75% of the run, weight decay 5e-4, batch 128, "
      "pad-crop + flip, a balanced subset of the training images, the whole test set of "
      "10,000, evaluated every few epochs as each run's settings say), on 2 CPU cores. The "
      "budget takes the widest width that a run fits into an hour and as many epochs as the "
      "plateau needs. Minutes are the whole run's wall time, evaluations included, on cores "
      "that some runs shared with other work (on idle cores a run takes less). A run fits "
      f"when it classifies ≥ {100 * pages.FIT_TRAIN_ACC:.0f}% of its training images (eval "
      f"mode) and its test accuracy gains ≤ {100 * pages.FIT_PLATEAU_GAIN:.1f} points over "
      "the last quarter of its epochs (the final LR's phase, from the quarter's first "
      "evaluation to its last)."
    ),
    "",
    (
      "- Each run's command is in its row (a table's dense run at the budget is the same run, "
      "trained once by whichever comes first); `python -m experiments.run fit_sizing "
      "--page-only --publish` rewrites this page."
    ),
    "",
    (
      "| model | width | params | train images | epochs | steps | min | wall s / step | "
      "train acc (%) | test acc (%) | test gain, last quarter | fits | budget | command |"
    ),
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
  ]
  for path, saved in runs:
    st, history = saved["settings"], saved["history"]
    steps = sum(r.get("steps", 0) for r in history)
    minutes = saved.get("wall_time_s", 0.0) / 60
    gain = saved.get("test_gain_last_quarter")
    fit = budgets.get_budget(TABLES[st["model"].partition("-")[0]], "fit")
    at_fit = (st["train_subset"], st["epochs"]) == (fit.train_subset, fit.epochs) and st[
      "width"
    ] == budgets.row_width(fit.width, st["model"])
    verdict = {True: "yes", False: "no", None: "—"}[pages.fits(saved)]
    lines.append(
      f"| {st['model']} | ×{st['width']:g} | {_params(st['model'], st['width']):,} "
      f"| {st['train_subset'] or 50_000:,} | {st['epochs']} | {steps:,} | {minutes:.1f} "
      f"| {saved.get('wall_time_s', 0.0) / max(steps, 1):.2f} "
      f"| {100 * saved['train_acc']:.2f} | {100 * history[-1]['test_acc']:.2f} "
      f"| {'—' if gain is None else f'{100 * gain:+.2f}'} | {verdict} "
      f"| {'`fit`' if at_fit else 'probe'} | `{_probe_command(st)}` |"
    )
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  folder = pages.output_dir(None, args.publish, args.out)
  record = None
  if not args.page_only:
    from jaxprune import data

    budget = args.recipe
    train_set = data.load("cifar10", root=args.root, split="train").balanced_subset(
      budget.train_subset, args.seed
    )
    test_set = data.load("cifar10", root=args.root, split="test").balanced_subset(
      budget.test_subset, args.seed + 1
    )
    spec = probe_spec(args, train_set, test_set, cli.command_line("fit_sizing", argv))
    record = rows.run_row(spec, args.options)
    if record is None:
      return {"stopped": spec.label}
    print(
      f"{spec.label}: train acc {100 * record['train_acc']:.2f}%, test acc "
      f"{100 * record['test_acc']:.2f}%, {record['wall_time_s'] / 60:.1f} min",
      flush=True,
    )
  page = folder / "fit_sizing.md"
  page.write_text(sizing_page(pages.shared_dir(args.publish, args.out)))
  return {"page": str(page), "record": record}

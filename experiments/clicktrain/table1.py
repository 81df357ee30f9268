"""ClickTrain Table 1 (CIFAR-10 rows): dense baseline vs ClickTrain, beside the paper.

Rows: the clicktrain family's ResNet-32 (4-stage BasicBlock, 64-512), ResNet-50,
VGG-11 and VGG-13 (and ResNet-18, not in Table 1, as a cheap stand-in for the
CPU budget run; it uses ResNet-32's per-stage ratios). The full recipe is the paper's
(§6.1): 190 epochs, batch 128, SGD momentum 0.9, lr 0.1 (x0.1 at 50% / 75% of the run:
the paper does not state its schedule), weight decay 5e-4, λ = 2.5e-4, stage-2 trigger =
loss derivative 0.27, pool of 12 patterns, hard prune at the paper's epoch for the row, per-layer
kernel-prune ratios from the authors' released code: ResNet-32 55 / 65 / 75% by
stage; VGG-11 35, 45, 65, 75, 80, 80, 85%. ResNet-50 and VGG-13 ratios are not
published; we use ResNet-32's by stage and VGG-11's stretched to 9 layers
(35, 40, 45, 55, 65, 75, 80, 80, 85%).

``--budget paper`` is that recipe; ``--budget cpu`` (the default) the reduced one every row
shares (``experiments/common/budgets.py``): width ×1/4 for the VGGs and ×1/8 for the ResNets (20-41
MFLOPs per image each) over the full training and test sets, 12
epochs at batch 128 (LR ×0.1 at 50% / 75%), stages at fixed epochs scaled to the run (warm-up
1, DPPG 1, finalize 1, regularize until 60% of the run, then hard pruned), pool of 12, and the
VGG classifier initialised N(0, 0.05) (at reduced width ClickTrain's N(0, 0.01) 3-layer MLP
stays at chance for hundreds of steps); dense and ClickTrain rows train identically.

    python -m experiments.run clicktrain_table1 --budget cpu --rows resnet32,vgg11 [--publish]

Each row writes ``table1_<budget>_<row>_<method>.json``, its epoch log (``logs/``) and PNG plots
of the final pattern pool (usage counts) and per-layer sparsity; the table page
``table1_<budget>.md`` gathers every row of the budget present in the folder beside the
paper's Table 1. All go to ``runs/clicktrain/``, or ``experiments/results/clicktrain/`` with
``--publish``. ``--dtype bf16`` trains the models in bfloat16 (parameters float32); its files
are named with the budget ``<budget>_bf16`` (``table1_cpu_bf16_vgg11_dense.json``, page
``table1_cpu_bf16.md``), so they never replace the fp32 rows. A run under a ``--seed`` other
than 0 is named with ``_seed<S>`` at the end and goes to the aligned page's seeds table
(``table1-aligned_<budget>.md``), never to the Table 1 page.

A row too long for one sitting runs in parts: every run checkpoints after each epoch
(``runs/checkpoints/``), and the same command with ``--resume`` continues it exactly.
``--loader``, ``--steps-per-dispatch``, ``--eval-every``, ``--checkpoint-every``,
``--max-seconds`` and ``--must-finish`` fit a paper-budget row into one accelerator command
(``experiments/common/run_options.py``); ``--methods dense`` or ``--methods clicktrain`` runs one
of a row's two trainings.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from experiments.clicktrain import aligned_page, transition_options
from experiments.common import budgets, cli, pages, rows, run_options
from jaxprune import data, flops, methods, models, train
from jaxprune.clicktrain import HardPruneReadout, PrunedStageStep, patterns, preset, readouts
from jaxprune.clicktrain.execution import SparseExecution

# Paper Table 1, CIFAR-10, first ClickTrain row per model:
# (base acc, Δ, compression, train / inference FLOPs saved, hard-prune epoch)
PAPER = {
  "resnet32": (93.6, 0.0, 8.6, 39.2, 79.2, 98),
  "resnet50": (94.1, 0.0, 8.7, 37.4, 74.9, 95),
  "vgg11": (92.1, -0.1, 8.6, 38.5, 70.0, 96),
  "vgg13": (93.8, 0.0, 7.2, 39.2, 78.4, 95),
}
# Not a Table 1 row: the narrow ResNet-18 is a reduced-budget stand-in. (The family's VGGs,
# with their std-0.01 3-layer dropout MLP, stay at chance for the first few hundred steps at
# width 1/4 or 1/8; ``--linear-init-std 0.05`` lets the VGG rows train within the budget.)
EXTRA_ROWS = ("resnet18",)
PRUNETRAIN = {
  "resnet32": (-2.1, 2.2),
  "resnet50": (-1.1, 2.2),
  "vgg11": (-0.7, 6.6),
  "vgg13": (-0.6, 6.3),
}


def _parse(argv):
  p = argparse.ArgumentParser(prog="clicktrain_table1", description=__doc__.splitlines()[0])
  cli.add_table_arguments(p, "clicktrain_table1")
  p.add_argument(
    "--rows",
    default="vgg11",
    help=f"comma list of {','.join(PAPER)} (and {','.join(EXTRA_ROWS)}, not a Table 1 row)",
  )
  p.add_argument(
    "--mode",
    default="paper",
    choices=["paper", "one_shot"],
    help="ClickTrain's rule: the paper's stages (§4) or one_shot (the authors' released code)",
  )
  p.add_argument("--skip-dense", action="store_true", help="the same as --methods clicktrain")
  p.add_argument(
    "--methods",
    default="dense,clicktrain",
    help="comma list of the row's trainings to run: dense, clicktrain (default both)",
  )
  p.add_argument(
    "--filter-groups",
    type=int,
    default=None,
    help="ClickTrain's aligned mode (beyond the paper) with this many filter groups; its runs "
    "are saved as method aligned-g<G> and switch to the aligned layers after the hard prune",
  )
  p.add_argument(
    "--width",
    type=float,
    default=None,
    help="every row at this width multiplier instead of the budget's (a width sweep: its files "
    "are marked _w<W>, table1_fit_w0.25_vgg11_dense.json, with pages of their own)",
  )
  p.add_argument(
    "--filter-grouping",
    default="consecutive",
    choices=["consecutive", "clustered"],
    help="with --filter-groups: the groups are runs of consecutive filters, or clustered from "
    "the filters' Eq. 2 / pattern scores when the patterns are finalized (saved as method "
    "aligned-g<G>c)",
  )
  transition_options.add_arguments(p)
  cli.add_resume_argument(p)
  cli.add_dtype_argument(p)
  run_options.add_arguments(p)
  a = p.parse_args(argv)
  a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
  if a.skip_dense:
    a.methods = [m for m in a.methods if m != "dense"]
  if not a.methods or set(a.methods) - {"dense", "clicktrain"}:
    p.error(f"--methods: choose from dense, clicktrain, got {a.methods}")
  if a.filter_grouping != "consecutive" and a.filter_groups is None:
    p.error("--filter-grouping needs --filter-groups")
  a = run_options.table_args(a, "clicktrain_table1")
  transition_options.check(p, a)
  return a


def _stage_epochs(args, row: str) -> dict[str, Any]:
  """The stage epochs this table sets for ``row`` in ``args.mode``.

  The ``cpu`` budget fixes every stage (one epoch each of warm-up, pool generation and
  finalization, the hard prune at ``hard_prune_fraction`` of the run); the ``paper`` budget
  sets the pool and finalization lengths and each Table 1 row's hard-prune epoch. What is left
  out comes from the preset (:func:`jaxprune.clicktrain.method`): the hard prune at half the
  run for a row the paper does not list, the one-shot mask pick 30/190 of the run before it,
  and §4.1's loss-derivative trigger for the pool.
  """
  budget = args.recipe
  if budget.hard_prune_fraction is not None:
    hard = args.hard_prune_epoch or max(4, round(budget.hard_prune_fraction * budget.epochs))
    if args.mode == "one_shot":
      return {"hard_prune_epoch": hard, "one_shot_epoch": 1}
    return {
      "pool_start_epoch": 1,
      "pool_epochs": budget.pool_epochs,
      "finalize_epochs": budget.finalize_epochs,
      "hard_prune_epoch": hard,
    }
  # The row's Table 1 epoch, at the same fraction of a run shorter than the paper's 190.
  paper_run = budgets.get_budget("clicktrain_table1", "paper").epochs
  epochs = (
    {"hard_prune_epoch": budgets.scaled_epochs(PAPER[row][5], paper_run, budget.epochs)}
    if row in PAPER
    else {}
  )
  if args.mode == "one_shot":
    return epochs
  return {"pool_epochs": budget.pool_epochs, "finalize_epochs": budget.finalize_epochs, **epochs}


def _method(args, row: str) -> methods.Method:
  """ClickTrain for ``row``: the registered preset with this table's ratios and stage epochs
  (and ``--filter-groups``: the aligned mode; the transition options when given)."""
  aligned = {}
  if args.filter_groups is not None:
    aligned = {"filter_groups": args.filter_groups, "filter_grouping": args.filter_grouping}
  return methods.get(
    "clicktrain",
    mode=args.mode,
    kernel_prune_ratio=preset.paper_kernel_ratios(f"clicktrain-{row}"),
    group_lasso_ramp=args.group_lasso_ramp,
    prune_window_epochs=args.prune_window_epochs,
    **_stage_epochs(args, row),
    **aligned,
  )


def _schedule(args, row: str, steps: int, prune: bool):
  """The row's step LR schedule; with ``--lr-rewind-epoch`` (ClickTrain runs) rewound after
  the hard prune."""
  budget = args.recipe
  milestones = [max(1, round(f * budget.epochs)) for f in budget.milestones]
  schedule = train.step_schedule(budget.lr, steps, milestones)
  if not prune or args.lr_rewind_epoch is None:
    return schedule
  return train.schedules.with_rewind(
    schedule,
    steps,
    prune_epoch=_stage_epochs(args, row)["hard_prune_epoch"],
    rewind_epoch=args.lr_rewind_epoch,
    total_epochs=budget.epochs,
  )


def _tag(budget: str, dtype: str = "fp32", width: float | None = None) -> str:
  """The budget part of a run's file names: ``budget``, with the dtype's marker when it is not
  fp32 (``cpu_bf16``) and the width of a ``--width`` run (``fit_w0.25``): a bf16 run's rows, or
  a width sweep's, and their pages stand apart from the budget's own."""
  return f"{budget}{cli.dtype_suffix(dtype)}" + ("" if width is None else f"_w{width:g}")


def _row_width(args, row: str) -> float:
  """``row``'s width: ``--width``, or the budget's for its family."""
  return args.width if args.width is not None else budgets.row_width(args.recipe.width, row)


def _spec(
  args, row: str, prune: bool, train_set, test_set, folder: Path, command: str
) -> rows.RowSpec:
  """One of ``row``'s runs (dense, or ClickTrain when ``prune``) as a row spec: its JSON and
  plots go to ``folder``, its epoch log to ``folder/logs``."""
  budget = args.recipe
  label = "clicktrain" if prune else "dense"
  if prune and args.filter_groups is not None:
    clustered = args.filter_grouping == "clustered"
    label = f"aligned-g{args.filter_groups}{'c' if clustered else ''}"
  if prune:
    label += transition_options.suffix(args)
  tag = _tag(args.budget, args.dtype, args.width)
  stem = aligned_page.run_stem(tag, row, label, args.seed)
  overrides = budgets.model_overrides(args.budget, f"clicktrain-{row}")

  def model():
    return models.create(
      f"clicktrain-{row}",
      num_classes=10,
      rngs=nnx.Rngs(args.seed),
      width_multiplier=_row_width(args, row),
      dtype=cli.compute_dtype(args),
      **overrides,
    )

  def callbacks(test_loader, run):
    hooks = []
    if prune and args.mode == "paper":
      # What the hard prune removes and costs, read at the epoch end before it (the group
      # lasso's job, ClickTrain §4.4): saved in that epoch's record. The hook reads the hard
      # prune's epoch from the schedule the preset placed in the transform's state.
      hooks.append(HardPruneReadout(test_loader))
    if prune and args.filter_groups is not None:
      # The aligned mode's point is cheaper epochs after the hard prune: switch the pruned
      # convs to the aligned layers there (each kept where it measures faster than the masked
      # dense conv), each layer's groups as the ClickTrain state holds them.
      hooks.append(SparseExecution(filter_groups="from_state"))
    if prune:
      # After the hard prune the train step is the pruned stage's, as the preset's hook makes
      # it (the table sets its own hooks).
      hooks.append(PrunedStageStep())
    return hooks

  # The dense run is the model's baseline at this budget, shared with every table that trains
  # the same model alike (PruneTrain's Table 1 on this family's networks).
  shared = None
  if not prune:
    shared = rows.shared_dense_run(
      args.budget,
      f"clicktrain-{row}",
      _row_width(args, row),
      budget,
      args.options,
      publish=args.publish,
      out=args.out,
      seed=args.seed,
      dtype=args.dtype,
      augment="clicktrain",
      model_overrides=overrides,
    )
  metrics = {"compression": lambda t: flops.compression_ratio(t.params)}
  if prune:
    metrics = {"stage": lambda t: readouts.stage_name(t.opt_state), **metrics}
  (folder / "logs").mkdir(parents=True, exist_ok=True)

  def save(result):
    if prune:
      _plots(result, folder / stem)
    (folder / f"{stem}.json").write_text(json.dumps(result, indent=2, default=float))

  return rows.RowSpec(
    label=f"{row} {label}",
    model=model,
    method=_method(args, row) if prune else methods.get("dense"),
    optimizer=lambda steps: train.sgd(
      _schedule(args, row, steps, prune), momentum=0.9, weight_decay=5e-4
    ),
    train_set=train_set,
    test_set=test_set,
    batch_size=budget.batch_size,
    augment="clicktrain",
    epochs=budget.epochs,
    seed=args.seed,
    result=lambda done: _result(done, row, label, args, command, stem, prune),
    callbacks=callbacks,
    metrics=metrics,
    log_path=folder / "logs" / f"{stem}.jsonl",
    checkpoint_dir=run_options.checkpoint_dir("clicktrain", stem, args.out),
    # A resume under other settings is refused, not mixed in.
    run_config={
      "row": row,
      "method": label,
      "mode": args.mode,
      "seed": args.seed,
      **budgets.as_saved(budget),
      **({} if args.width is None else {"width_sweep": args.width}),
      **cli.dtype_config(args),
      **run_options.run_config(args.options),
    },
    # The released code switches to mixup (α = 0.3) after the hard prune: train up to the
    # epoch whose end finds the stage pruned (the preset placed it), then mixup batches.
    switch=(_pruned, "clicktrain-mixup") if prune and args.mode == "one_shot" else None,
    save=save,
    shared=shared,
  )


def _pruned(trainer) -> bool:
  return readouts.stage_name(trainer.opt_state) == "pruned"


def _result(row_run: rows.Row, row, label, args, command, stem, prune) -> dict[str, Any]:
  """The record of one of ``row``'s finished runs (ClickTrain's: with its stage, FLOPs saved,
  per-layer sparsity and pattern pool)."""
  trainer = row_run.trainer
  history = trainer.history
  result = {
    "row": row,
    "method": label,
    "seed": args.seed,
    **cli.dtype_config(args),
    "test_acc": history[-1]["test_acc"],
    "compression": flops.compression_ratio(trainer.params),
    "wall_time_s": history[-1]["wall_time_s"],
    "command": command,
    "log": f"logs/{stem}.jsonl",
    "history": history,
  }
  if prune:
    st = trainer.opt_state
    saved = readouts.flops_saved(trainer.model, st, (1, 32, 32, 3))
    result.update(
      stage=readouts.stage_name(st),
      flops_saved=saved,
      layer_sparsity=_layer_sparsity(trainer.params),
      live_input_channels=_live_inputs(trainer.params, (0, 1, 3)),
      live_input_taps=_live_inputs(trainer.params, (3,)),
      pattern_usage={
        int(k): [v[0].tolist(), v[1].tolist()] for k, v in readouts.pattern_usage(st).items()
      },
      pool=[
        int(i) for i in next((ls.pool for ls in st.layers.values() if ls.pool is not None), [])
      ],
    )
  return result


def _conv_kernels(params) -> dict[str, np.ndarray]:
  """Every conv kernel (4-D parameter) of ``params`` by its layer's path."""
  return {
    "/".join(str(getattr(k, "key", k)) for k in path[:-1]): np.asarray(w)
    for path, w in jax.tree_util.tree_flatten_with_path(params)[0]
    if np.ndim(w) == 4
  }


def _layer_sparsity(params) -> dict[str, float]:
  """Fraction of exactly-zero weights per conv layer (after the hard prune: the masks)."""
  return {name: float(np.mean(w == 0)) for name, w in _conv_kernels(params).items()}


def _live_inputs(params, axis: tuple[int, ...]) -> dict[str, float]:
  """Fraction of each conv's input channels (``axis=(0, 1, 3)``) or (tap, input channel) pairs
  (``axis=(3,)``) that some filter still reads through a kept weight: in the aligned mode, the
  union over its filter groups, which is what columns shared by the groups would hold."""
  return {
    name: float(np.mean((w != 0).any(axis=axis))) for name, w in _conv_kernels(params).items()
  }


def _plots(result: dict[str, Any], stem: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  usage = result["pattern_usage"].get(3)
  if usage:
    ids, counts = usage
    table = patterns.all_patterns(4, 3)
    n = len(ids)
    fig, axes = plt.subplots(
      2, n, figsize=(1.2 * n + 1, 3.2), gridspec_kw={"height_ratios": [1, 2.5]}, squeeze=False
    )
    for j, (pid, c) in enumerate(zip(ids, counts)):
      axes[0, j].imshow(table[pid], cmap="Greys", vmin=0, vmax=1)
      axes[0, j].set_xticks([]), axes[0, j].set_yticks([])
      axes[0, j].set_title(f"#{pid}", fontsize=7)
      axes[1, j].bar([0], [c], color="tab:blue")
      axes[1, j].set_ylim(0, max(counts) * 1.1)
      axes[1, j].set_xticks([])
      axes[1, j].text(0, c, str(c), ha="center", va="bottom", fontsize=7)
      if j:
        axes[1, j].set_yticks([])
    fig.suptitle(f"{result['row']}: final patterns (kept kernels using each)", fontsize=9)
    fig.tight_layout()
    fig.savefig(f"{stem}_patterns.png", dpi=110)
    plt.close(fig)
  sp = result["layer_sparsity"]
  fig, ax = plt.subplots(figsize=(max(4, 0.35 * len(sp) + 2), 3))
  ax.bar(range(len(sp)), [100 * v for v in sp.values()], color="tab:orange")
  ax.set_xticks(range(len(sp)))
  short = [k.removesuffix("/conv").replace("stages/", "s").replace("features/", "f") for k in sp]
  ax.set_xticklabels(short, rotation=90, fontsize=6)
  ax.set_ylabel("zero weights (%)")
  ax.set_title(f"{result['row']}: per-layer conv sparsity", fontsize=9)
  fig.tight_layout()
  fig.savefig(f"{stem}_sparsity.png", dpi=110)
  plt.close(fig)


def _markdown(args, results: dict[str, dict[str, dict[str, Any]]], command: str) -> str:
  """The table page of ``results`` (row -> method -> run). Rows run by separate invocations
  share the page, so it names each run's command (``command`` for a run that has none)."""
  table_rows, logs = [], {}
  for row, res in results.items():
    paper = PAPER.get(row)
    dense, clk = res.get("dense"), res.get("clicktrain")
    for method, run in (("dense", dense), ("ClickTrain", clk)):
      if run is None:
        continue
      label = f"{row} {method}"
      if method == "dense":
        theirs = [paper and paper[0], None, None, None]
        ours = [f"{100 * run['test_acc']:.2f}", None, f"{run['compression']:.2f}x", None]
      else:
        theirs = [
          None,
          paper and f"{paper[1]:+.1f}",
          paper and f"{paper[2]}x",
          paper and f"{paper[3]}% / {paper[4]}%",
        ]
        delta = 100 * (run["test_acc"] - dense["test_acc"]) if dense else None
        fs = run["flops_saved"]
        ours = [
          f"{100 * run['test_acc']:.2f}",
          None if delta is None else f"{delta:+.2f}",
          f"{run['compression']:.2f}x",
          f"{100 * fs['training']:.1f}% / {100 * fs['inference']:.1f}%",
        ]
      table_rows.append((label, theirs, ours))
      if "log" in run:
        logs[label] = run["log"]
  runs = [run for res in results.values() for run in res.values()]
  page = pages.results_page(
    "ClickTrain Table 1 — CIFAR-10, dense vs ClickTrain",
    command=pages.joined_commands(runs, default=command),
    budget_name=args.budget,
    budget=budgets.get_budget("clicktrain_table1", args.budget),
    **run_options.page_provenance(runs),
    columns=["acc (%)", "Δ acc (points)", "compression", "train / inference FLOPs saved"],
    rows=table_rows,
    logs=logs,
    notes=[
      *(
        [f"Width sweep: every row at width ×{args.width:g}, not the budget's (`--width`)."]
        if args.width is not None
        else []
      ),
      (
        f"ClickTrain mode: `{args.mode}`; data: the JPEG re-encoded CIFAR-10 (accuracies a "
        "little under published numbers)."
      ),
      "Paper: 190 epochs at full width; hard prune at epoch "
      + ", ".join(f"{r} {p[5]}" for r, p in PAPER.items())
      + "; PruneTrain in the same table: "
      + ", ".join(f"{r} {d:+.1f} points at {c}x" for r, (d, c) in PRUNETRAIN.items())
      + ".",
      (
        "FLOPs saved (ours) are per step once hard-pruned (sparse conv accounting of "
        "`jaxprune.flops`: pruned weights skipped in forward and both backward convs); the "
        "paper's training column averages over the whole run."
      ),
      *([_budget_note(args.budget)] if args.budget != "paper" else []),
      *cli.dtype_notes(args),
    ],
  )
  lines = [page]
  lines += pages.fit_section(
    [(f"{row} {method}", run) for row, res in results.items() for method, run in res.items()]
  )
  for row, res in results.items():
    clk = res.get("clicktrain")
    if clk:
      stem = f"table1_{_tag(args.budget, args.dtype, args.width)}_{row}_clicktrain"
      lines += [
        f"## {row}: pattern pool and per-layer sparsity",
        "",
        (
          f"- final stage: {clk['stage']}; hard prune at epoch "
          f"{aligned_page.pruned_at(clk) or '—'}; pool (ids into `all_patterns(4, 3)`, "
          f"most competitive first): {clk['pool']}"
        ),
        f"- {aligned_page.prune_readout(clk)}",
        "- patterns used by kept kernels (id: count): "
        + ", ".join(f"{i}: {c}" for i, c in zip(*clk["pattern_usage"].get("3", [[], []]))),
        f"- ![patterns]({stem}_patterns.png)",
        f"- ![sparsity]({stem}_sparsity.png)",
        "",
        "| layer | zero weights |",
        "|---|---:|",
      ]
      lines += [f"| {k} | {100 * v:.1f}% |" for k, v in clk["layer_sparsity"].items()]
      lines.append("")
  return "\n".join(lines) + "\n"


def _budget_note(budget: str) -> str:
  """What a reduced budget's rows compare with: at `fit` the dense networks fit their data, so
  the Δ column compares with the paper's Δ; at `cpu` they do not."""
  if budget == "fit":
    return (
      "The `fit` budget: the dense network fits its training data (the section below), so our "
      "Δ compares with the paper's Δ; the accuracy columns do not (2,560 training images, "
      "reduced width)."
    )
  return (
    "Reduced budget: compare dense vs ClickTrain within this table, not with the paper's "
    "accuracy columns."
  )


def aligned_markdown(
  folder: Path, budget: str, dtype: str = "fp32", width: float | None = None
) -> str:
  """The aligned mode's page (beyond the paper): every row with aligned runs beside its dense and
  fine-grained ClickTrain runs of the same budget, seed, ``dtype`` and ``--width``, and the runs
  of other seeds below (:mod:`experiments.clicktrain.aligned_page`)."""
  tag = _tag(budget, dtype, width)
  return aligned_page.aligned_markdown(
    folder, budget, tag, PAPER, (*PAPER, *EXTRA_ROWS), cli.dtype_notes(dtype)
  )


def _saved_rows(
  folder: Path, budget: str, dtype: str = "fp32", width: float | None = None
) -> dict[str, dict[str, Any]]:
  """Every row of ``budget`` at ``dtype`` (and ``--width``) whose JSON is in ``folder`` (rows
  run separately share a page)."""
  results: dict[str, dict[str, Any]] = {}
  for row in (*PAPER, *EXTRA_ROWS):
    for method in ("dense", "clicktrain"):
      path = folder / f"table1_{_tag(budget, dtype, width)}_{row}_{method}.json"
      if path.exists():
        results.setdefault(row, {})[method] = json.loads(path.read_text())
  return results


def _on_table1_page(args, prune: bool) -> bool:
  """Whether a run belongs to the Table 1 page: seed 0, fine-grained or dense, and (when
  pruned) without transition options; every other run goes to the aligned page."""
  return (
    args.filter_groups is None and not args.seed and not (prune and transition_options.suffix(args))
  )


def write_pages(folder: Path, budget: str, dtype: str = "fp32") -> Path:
  """Rewrites ``table1_<budget>.md`` in ``folder`` from the rows saved there (and the aligned
  page when aligned runs are there), e.g. after rows trained elsewhere were copied in; returns
  the Table 1 page."""
  args = _parse(["--budget", budget, "--dtype", dtype])
  tag = _tag(budget, dtype)
  page = folder / f"table1_{tag}.md"
  page.write_text(_markdown(args, _saved_rows(folder, budget, dtype), "-"))
  if any(folder.glob(f"table1_{tag}_*_aligned-g*.json")):
    (folder / f"table1-aligned_{tag}.md").write_text(aligned_markdown(folder, budget, dtype))
  return page


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  command = cli.command_line("clicktrain_table1", argv)
  chosen = [r.strip() for r in args.rows.split(",") if r.strip()]
  for r in chosen:
    if r not in PAPER and r not in EXTRA_ROWS:
      raise ValueError(f"--rows: unknown row {r!r}; choose from {sorted(PAPER) + list(EXTRA_ROWS)}")
  folder = pages.output_dir("clicktrain", args.publish, args.out)
  train_set = data.load("cifar10", root=args.root, split="train").balanced_subset(
    args.recipe.train_subset, args.seed
  )
  test_set = data.load("cifar10", root=args.root, split="test").balanced_subset(
    args.recipe.test_subset, args.seed + 1
  )
  tag = _tag(args.budget, args.dtype, args.width)
  out = folder / f"table1_{tag}.md"
  results: dict[str, dict[str, Any]] = {}
  for row in chosen:
    results[row] = {}
    for method in ("dense", "clicktrain"):
      if method not in args.methods:
        continue
      prune = method == "clicktrain"
      spec = _spec(args, row, prune, train_set, test_set, folder, command)
      res = rows.run_row(spec, args.options)
      if res is None:  # stopped at --max-seconds: the command ends here
        return {"stopped": f"{row} {method}"}
      results[row]["clicktrain" if prune else "dense"] = res
      if _on_table1_page(args, prune):
        saved = _saved_rows(folder, args.budget, args.dtype, args.width)
        out.write_text(_markdown(args, saved, command))
      else:  # the aligned runs, runs with transition options or other seeds: their own page
        page = aligned_markdown(folder, args.budget, args.dtype, args.width)
        (folder / f"table1-aligned_{tag}.md").write_text(page)
      print(
        f"{row} {res['method']}: acc {100 * res['test_acc']:.2f}% "
        f"compression {res['compression']:.2f}x",
        flush=True,
      )
      if prune:  # in the command's output too: a window's files may not all come back
        print(f"{row} {res['method']}: {aligned_page.prune_readout(res)}", flush=True)
  return {
    r: {k: {kk: vv for kk, vv in v.items() if kk != "history"} for k, v in res.items()}
    for r, res in results.items()
  }


if __name__ == "__main__":
  main()

"""The pages of PruneTrain Table 1 (``experiments/prunetrain/table1.py``): one per row, with
its per-epoch channels / FLOPs table and plot, and the table page gathering the rows."""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.common import budgets, cli, pages, run_options
from experiments.common.machine import machine_description


def _paper_share(paper: dict[str, Any], key: str) -> str:
  """A paper's FLOPs or time fraction as a cell; ``—`` where its table gives none (ClickTrain
  Table 1's PruneTrain rows give the accuracy change and compression only)."""
  return "—" if paper.get(key) is None else f"{100 * paper[key]:.0f}%"


def _percent(value: float | None) -> str:
  """A test accuracy cell; ``—`` for an epoch that was not evaluated (``--eval-every``)."""
  return "—" if value is None else f"{100 * value:.2f}%"


def table_page(
  folder: Path, budget_name: str, command: str, rows: Sequence[str], dtype: str = "fp32"
) -> Path:
  """``table1_<budget>.md``: every row of ``rows`` of this budget in ``folder`` beside the
  paper's Table 1 (the rows' JSON files are the source, so rows run separately share one page,
  which names each row's command; ``command`` for a row saved without one). Rows trained at
  another ``dtype`` than fp32 have their own files and page (``table1_<budget>_bf16.md``)."""
  budget = budgets.as_saved(budgets.get_budget("prunetrain_table1", budget_name))
  tag = f"{budget_name}{cli.dtype_suffix(dtype)}"
  table_rows, logs, shown, fit_runs = [], {}, [], []
  for row in rows:
    path = folder / f"table1_{tag}_{row}.json"
    if not path.exists():
      continue
    saved = json.loads(path.read_text())
    if saved["args"].get("dtype", "fp32") != dtype:  # saved before --dtype existed: fp32
      warnings.warn(
        f"{path.name}: trained at dtype {saved['args'].get('dtype', 'fp32')}, not {dtype}; "
        "left off the table page",
        RuntimeWarning,
        stacklevel=2,
      )
      continue
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
    fit_runs += [(f"{row} {method}", run) for method, run in runs.items()]
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
    table_rows.append(
      (
        label,
        [
          None,
          f"{paper['acc_delta']:+.1f}",
          _paper_share(paper, "train_flops"),
          _paper_share(paper, "inference_flops"),
        ],
        ours,
      )
    )
    logs[label] = f"logs/{path.stem}_prunetrain.jsonl"
  page = pages.results_page(
    "PruneTrain Table 1 — CIFAR-10, dense vs PruneTrain",
    command=pages.joined_commands(shown, default=command),
    budget_name=budget_name,
    budget=budgets.get_budget("prunetrain_table1", budget_name),
    **run_options.page_provenance(shown),
    columns=["dense acc (%)", "Δ acc (points)", "train FLOPs", "inference FLOPs"],
    rows=table_rows,
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
      *cli.dtype_notes(dtype),
    ],
  )
  fit = pages.fit_section(fit_runs)
  out = folder / f"table1_{tag}.md"
  out.write_text("\n".join([page, *fit]))
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


def penalty_shrink_bound(run: Mapping[str, Any], momentum: float = 0.9) -> float:
  """Σ over the run's steps of lr·λ / (1 − momentum): how far the group lasso alone moves a
  group's L2 norm (its gradient λ·w/‖w‖ has norm λ; SGD with momentum takes ``1 / (1 −
  momentum)`` times a step's gradient in steady state). A group whose norm starts above it
  cannot die from the penalty, whatever the loss does (PruneTrain Eq. 3)."""
  lr_steps = sum(record["steps"] * record["lr"] for record in run["history"])
  return lr_steps * run["lambda"] / (1.0 - momentum)


def row_page(
  stem: Path,
  args: argparse.Namespace,
  runs: dict[str, Any],
  command: str,
  paper: dict[str, float],
  date: str | None = None,
) -> None:
  """``stem.{json,md}``: one row's runs (``runs``: method -> result) beside the paper's
  numbers for the row, with the per-epoch table and the channels / FLOPs plot. ``date``: the
  row's (default now); a page rewritten from its JSON keeps it, and the machine its runs
  recorded."""
  date = date or pages.utc_now()
  recorded = [run.get("machine") for run in runs.values() if run.get("machine")]
  machine = recorded[-1] if recorded else machine_description()
  # Not with_suffix: a probe's stem may hold a ratio ("..._r0.9").
  stem.parent.joinpath(f"{stem.name}.json").write_text(
    json.dumps(
      {
        "args": vars(args),
        "command": command,
        "date": date,
        "paper": paper,
        "runs": runs,
      },
      indent=1,
      default=str,
    )
  )
  pt_run, dense = runs.get("prunetrain"), runs.get("dense")
  lines = [
    f"# PruneTrain Table 1, CIFAR-10 {args.model}, budget `{args.budget}`",
    "",
    f"- Command: `{command}`",
    f"- Date: {date}; machine: {machine}",
    (
      f"- Data: {args.train_subset or 50000} training / {args.test_subset or 10000} test images "
      f"of the JPEG-re-encoded CIFAR-10; pad-4 crop + flip; model width ×{getattr(args, 'row_width', args.width):g}."
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
    *(f"- {note}" for note in cli.dtype_notes(args)),
  ]
  if args.budget == "fit":
    lines.append(
      "- The `fit` budget: the papers' ratio and threshold, a reconfiguration every 10/182 of "
      "the run, on 2,560 training images until the dense network fits them (see the fit section "
      "below); our Δ compares with the paper's Δ, the accuracies do not."
    )
  elif args.budget != "paper":
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
    f"| {_paper_share(paper, 'train_flops')} (time {_paper_share(paper, 'train_time')}) "
    f"| {_paper_share(paper, 'inference_flops')} | — | — |"
  )
  if pt_run:
    named = _named_runs(pt_run, dense)
    lines += [
      "",
      "| PruneTrain extra | value |",
      "|---|---:|",
      f"| λ (set at step 1 from ratio {args.penalty_ratio}) | {pt_run['lambda']:.3g} |",
      "| the most the penalty alone shrinks a group's L2 norm over the run, Σ lr·λ / (1 − "
      "momentum) (a fresh group's: 1 to 1.41 under the He fan-out init) "
      f"| {penalty_shrink_bound(pt_run):.3g} |",
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
        f"| {r['epoch']} | {_percent(r.get('test_acc'))} {before}| {r['batch_size']} "
        f"| {_after(r, 'pt_inference_flops') / 1e6:.1f} "
        f"| {_after(r, 'pt_params'):,.0f} "
        f"| {r.get('pt_channels_removed') or 0} |"
      )
    if args.paired and dense:
      lines += ["", *_paired_epoch_rows(pt_run, dense)]
    plot = _plot_over_training(pt_run, stem)
    if plot is not None:
      lines += ["", f"![channels and FLOPs over training]({plot.name})"]
  lines += ["", *pages.fit_section([(method, run) for method, run in runs.items()])]
  lines += [
    "",
    "Per-epoch logs: "
    + ", ".join(f"[{m}](logs/{stem.name}_{m}.jsonl)" for m in runs if m in ("dense", "prunetrain")),
  ]
  stem.parent.joinpath(f"{stem.name}.md").write_text("\n".join(lines) + "\n")


def _after(record: dict[str, Any], key: str) -> Any:
  """``key`` of the model an epoch left: ``key + "_after"`` where it reconfigured, else
  ``key``. Older logs leave the ``_after`` entries out, newer ones hold ``None`` there."""
  after = record.get(f"{key}_after")
  return record[key] if after is None else after


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
  flops = [_after(r, "pt_inference_flops") / flops0 for r in history]
  params = [_after(r, "pt_params") / params0 for r in history]
  removed, total = [], 0
  for r in history:
    total += r.get("pt_channels_removed") or 0
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

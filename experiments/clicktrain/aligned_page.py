"""The page of ClickTrain's aligned mode (beyond the paper): each row's aligned runs beside its
dense and fine-grained runs of one budget and seed, and, where a row was run under more seeds,
a table of every seed's accuracy and their mean.

A run's files are named ``table1_<tag>_<row>_<method>[_seed<S>]``: seed 0 (the table's seed)
has no suffix, so the Table 1 page, which reads the seed-0 names only, is unchanged by a run
under another seed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_SEED = "_seed"


def run_stem(tag: str, row: str, method: str, seed: int) -> str:
  """The file stem of one run: ``table1_<tag>_<row>_<method>``, ``_seed<S>`` added for a seed
  other than 0."""
  return f"table1_{tag}_{row}_{method}" + (f"{_SEED}{seed}" if seed else "")


def _saved_runs(folder: Path, tag: str, row: str) -> dict[tuple[str, int], dict[str, Any]]:
  """Every saved run of ``row`` at ``tag`` in ``folder``, keyed by (method, seed)."""
  runs = {}
  for path in sorted(folder.glob(f"table1_{tag}_{row}_*.json")):
    name = path.stem.split(f"table1_{tag}_{row}_", 1)[1]
    method, _, seed = name.partition(_SEED)
    runs[method, int(seed or 0)] = json.loads(path.read_text())
  return runs


def pruned_at(run: Mapping[str, Any]) -> int | None:
  """The epoch after which a saved run's stage first read ``pruned`` (its hard prune)."""
  return next((r["epoch"] for r in run.get("history", ()) if r.get("stage") == "pruned"), None)


def _readout_record(run: Mapping[str, Any]) -> Mapping[str, Any] | None:
  """The record of a saved run that holds its hard-prune read-out (``None``: none does)."""
  return next((r for r in run.get("history", ()) if "hard_prune_removed_norm_fraction" in r), None)


def prune_readout(run: Mapping[str, Any]) -> str:
  """A saved run's hard-prune read-out (:class:`jaxprune.clicktrain.HardPruneReadout`, in the
  record of the epoch before the prune) as one sentence for a page: the share of the pruned
  layers' squared weight norm the prune removes (and the three layers it takes most from), the
  test accuracy before, masked, masked with BatchNorm re-estimated, and at the end of the
  prune's epoch where that epoch was evaluated."""
  record = _readout_record(run)
  if record is None:
    return "hard-prune read-out: not in this run's records"
  by_layer = record.get("hard_prune_removed_norm_fraction_by_layer") or {}
  most = sorted(by_layer.items(), key=lambda item: -item[1])[:3]
  after = next(
    (r.get("test_acc") for r in run["history"] if r["epoch"] == record["epoch"] + 1), None
  )
  return (
    f"hard-prune read-out (end of epoch {record['epoch']}, just before the prune): the prune "
    f"removes {100 * record['hard_prune_removed_norm_fraction']:.1f}% of the pruned layers' "
    "squared weight norm"
    + (f" (most from {', '.join(f'`{k}` {100 * v:.1f}%' for k, v in most)})" if most else "")
    + f"; test accuracy {100 * record['hard_prune_test_acc_before']:.2f}% before, "
    f"{100 * record['hard_prune_test_acc_after_no_bn']:.2f}% masked, "
    f"{100 * record['hard_prune_test_acc_after']:.2f}% masked with BatchNorm re-estimated"
    + (f", {100 * after:.2f}% at the end of the prune's epoch" if after is not None else "")
  )


def _epoch_s(run: Mapping[str, Any], at: int | None, after: bool) -> float | None:
  """Mean epoch time of a run before (epochs 2..``at``: the first compiles) or after the hard
  prune's epoch ``at``."""
  if not at:
    return None
  times = [
    r["epoch_time_s"]
    for r in run["history"]
    if (r["epoch"] > at if after else 1 < r["epoch"] <= at)
  ]
  return sum(times) / len(times) if times else None


def _aligned_order(method: str) -> tuple[int, str]:
  """``aligned-g<G>[c][-<transition option>...]`` by ``G`` (numerically), then by name: the
  consecutive groups before the clustered, each without the transition options first."""
  groups = method.removeprefix("aligned-g")
  digits = len(groups) - len(groups.lstrip("0123456789"))
  return int(groups[:digits]), groups


def _methods(runs: Mapping[tuple[str, int], Any]) -> list[str]:
  """The methods of ``runs`` in page order: dense, fine-grained, fine-grained with transition
  options (``clicktrain-<options>``), then aligned by G."""
  names = {m for m, _ in runs}
  aligned = sorted((m for m in names if m.startswith("aligned")), key=_aligned_order)
  fine_options = sorted(m for m in names if m.startswith("clicktrain-"))
  return [m for m in ("dense", "clicktrain") if m in names] + fine_options + aligned


def _against_fine(method: str) -> bool:
  """Whether a method's runs are compared with the fine-grained run of their seed: every run
  but the dense and the fine-grained one."""
  return method not in ("dense", "clicktrain")


def _row_prune_epoch(runs: Mapping[tuple[str, int], Mapping[str, Any]]) -> int | None:
  """The row's hard-prune epoch, for runs that never prune (dense): the fine-grained run's, or
  any run's when there is none."""
  return pruned_at(runs.get(("clicktrain", 0)) or next(iter(runs.values())))


def _run_lines(row: str, runs: Mapping[tuple[str, int], Mapping[str, Any]]) -> list[str]:
  """The main table's lines for ``row``: its seed-0 runs."""
  dense, fine = runs[("dense", 0)], runs.get(("clicktrain", 0))
  default_at = _row_prune_epoch(runs)
  lines = []
  for method in _methods({k: v for k, v in runs.items() if k[1] == 0}):
    r = runs[method, 0]
    at = pruned_at(r) or default_at
    before, after = _epoch_s(r, at, False), _epoch_s(r, at, True)
    # the last evaluation at or before the prune (a budget that evaluates every few epochs
    # may not have evaluated the prune's epoch itself)
    evaluated = [h for h in r["history"] if "test_acc" in h and h["epoch"] <= at]
    at_prune = evaluated[-1]["test_acc"] if evaluated else None
    readout = _readout_record(r)
    removed = None if readout is None else readout["hard_prune_removed_norm_fraction"]
    vs_fine = (
      f"{100 * (r['test_acc'] - fine['test_acc']):+.2f}"
      if fine is not None and _against_fine(method)
      else "–"
    )
    lines.append(
      f"| {row} | {method} | {100 * r['test_acc']:.2f}% | "
      f"{100 * (r['test_acc'] - dense['test_acc']):+.2f} | {vs_fine} | "
      f"{r['compression']:.2f}× | {'–' if at_prune is None else f'{100 * at_prune:.2f}%'} | "
      f"{'–' if removed is None else f'{100 * removed:.1f}%'} | "
      f"{r['history'][-1]['train_loss']:.3f} | "
      f"{before:.0f} / {after:.0f} | {after / before:.2f}× |"
    )
  return lines


def _seed_lines(row: str, runs: Mapping[tuple[str, int], Mapping[str, Any]]) -> list[str]:
  """The seeds table of ``row`` (empty where every run is seed 0): each method run under some
  other seed, its accuracy per seed, their mean, and the mean of its differences to the
  fine-grained run of the same seed (over the seeds that have both)."""
  seeds = sorted({s for _, s in runs})
  if seeds == [0]:
    return []
  lines = [
    f"| row | method | {' | '.join(f'seed {s}' for s in seeds)} | mean | mean Δ vs fine-grained |",
    "|---|---|" + "---:|" * (len(seeds) + 2),
  ]
  for method in _methods(runs):
    accs = {s: runs[method, s]["test_acc"] for s in seeds if (method, s) in runs}
    if set(accs) == {0}:
      continue  # one seed: the main table has it
    deltas = [
      accs[s] - runs["clicktrain", s]["test_acc"] for s in accs if ("clicktrain", s) in runs
    ]
    cells = [f"{100 * accs[s]:.2f}%" if s in accs else "–" for s in seeds]
    mean_delta = (
      f"{100 * sum(deltas) / len(deltas):+.2f} ({len(deltas)})"
      if _against_fine(method) and deltas
      else "–"
    )
    mean = 100 * sum(accs.values()) / len(accs)
    lines.append(f"| {row} | {method} | {' | '.join(cells)} | {mean:.2f}% | {mean_delta} |")
  return [*lines, ""]


# The aligned mode's accuracy targets at the same compression: the best run with G <= 8 within
# this many points of the fine-grained run, and the best with G = 1 (means over seeds).
TARGETS = ((8, 1.0), (1, 2.0))
# and the aligned epochs after the prune at most this share of the epochs before.
AFTER_OVER_BEFORE = 0.7
# The fine-grained accuracy (%) published before the aligned mode's transition options, by
# (budget, row): the options must not cost the paper mode more than a point of it.
FINE_REFERENCE = {("cpu", "vgg11"): 70.7}
# The techniques table's order: the plain run, then one technique at a time, then combinations.
_TECHNIQUE_ORDER = ("", "c", "-rampc", "-win2", "-rw3", "-rampc-win2-rw3")
# What each mark of a run name's suffix stands for (``transition_options.suffix``).
_MARKS = {
  "rampc": "cubic λ ramp",
  "rampl": "linear λ ramp",
  "win": "soft prune, {}-epoch window",
  "rw": "LR rewinding to epoch {}",
  "hp": "hard prune after epoch {}",
}


def _technique(suffix: str) -> str:
  """What a run name's suffix (``c``, ``-rampc-win2-rw3``, ...) stands for, in words."""
  if not suffix:
    return "none (the paper's one-step prune)"
  words = ["clustered groups"] if suffix.startswith("c") else []
  for mark in suffix.lstrip("c").split("-")[1:]:
    letters = mark.rstrip("0123456789")
    known = _MARKS.get(letters)
    words.append(known.format(mark[len(letters) :]) if known else f"`{mark}`")
  return " + ".join(words)


def _split_method(method: str) -> tuple[int, str]:
  """``aligned-g<G><suffix>`` as ``(G, suffix)``."""
  groups, name = _aligned_order(method)
  return groups, name[len(str(groups)) :]


def _mean_delta(
  runs: Mapping[tuple[str, int], Mapping[str, Any]], method: str, against: str = "clicktrain"
):
  """``(mean Δ vs the run of method ``against`` (the fine-grained one) in points, seeds)`` over
  the seeds with both runs, or None."""
  deltas = [
    run["test_acc"] - runs[against, s]["test_acc"]
    for (m, s), run in runs.items()
    if m == method and (against, s) in runs
  ]
  return (100 * sum(deltas) / len(deltas), len(deltas)) if deltas else None


def _target_lines(
  row: str, runs: Mapping[tuple[str, int], Mapping[str, Any]], reference: float | None = None
) -> list[str]:
  """How far the aligned runs of ``row`` got against :data:`TARGETS`, each technique's
  difference to the fine-grained run at G = 1 and G = 8, the fine-grained runs against their
  published accuracy ``reference`` (in %) and with transition options, the epochs after the prune
  of the runs timed alone, and, where a target is missed, the training losses that say why
  (empty for a row without fine-grained or aligned runs with G <= 8)."""
  aligned = {m: _mean_delta(runs, m) for m, s in runs if m.startswith("aligned") and s == 0}
  aligned = {m: d for m, d in aligned.items() if d is not None and _split_method(m)[0] <= 8}
  if ("clicktrain", 0) not in runs or not aligned:
    return []

  def fmt(delta):
    return f"{delta[0]:+.2f} ({delta[1]})"

  lines = [
    "| row | target | best run | mean Δ vs fine-grained (seeds) | met |",
    "|---|---|---|---:|---|",
  ]
  missed = False
  for most, points in TARGETS:
    best = max(
      (m for m in aligned if _split_method(m)[0] <= most), key=lambda m: aligned[m][0], default=None
    )
    if best is not None:
      met = aligned[best][0] >= -points
      missed |= not met
      name = f"G ≤ {most}" if most > 1 else "G = 1"
      unit = "point" if points == 1 else "points"
      lines.append(
        f"| {row} | {name} within {points:.0f} {unit} | {best} | {fmt(aligned[best])} | "
        f"{'yes' if met else 'no'} |"
      )
  by_technique: dict[str, dict[int, tuple[float, int]]] = {}
  for method, delta in aligned.items():
    groups, suffix = _split_method(method)
    by_technique.setdefault(suffix, {})[groups] = delta
  known = [k for k in _TECHNIQUE_ORDER if k in by_technique]
  lines += ["", "| row | technique | G = 1 | G = 8 |", "|---|---|---:|---:|"]
  for suffix in known + sorted(set(by_technique) - set(known)):
    cells = [fmt(by_technique[suffix][g]) if g in by_technique[suffix] else "–" for g in (1, 8)]
    lines.append(f"| {row} | {_technique(suffix)} | {' | '.join(cells)} |")
  lines += _fine_lines(row, runs, reference)
  speed = {False: [], True: []}  # runs without and with the pruned stage's specialised step
  for method in _methods(runs):
    if not method.startswith("aligned") or _split_method(method)[0] not in (1, 8):
      continue
    for seed in sorted(s for m, s in runs if m == method):
      run = runs[method, seed]
      at = pruned_at(run)
      specialised = any(r.get("ct_pruned_step") for r in run["history"])
      if at and not run.get("note") and (specialised or method in ("aligned-g1", "aligned-g8")):
        ratio = _epoch_s(run, at, True) / _epoch_s(run, at, False)
        name = method + (f" seed {seed}" if seed else "")
        speed[specialised].append(f"{name} {ratio:.2f}×")
  labels = ("the runs without options, general step", "with the pruned stage's specialised step")
  parts = [f"{labels[key]}: {', '.join(names)}" for key, names in speed.items() if names]
  if parts:
    lines += [
      "",
      (
        f"Epochs after the prune over the epochs before (target ≤ {AFTER_OVER_BEFORE}×; runs "
        f"timed alone): {'; '.join(parts)}."
      ),
    ]
  if not missed:
    return lines
  gains = []
  for g in (1, 8):
    plain = by_technique.get("", {}).get(g)
    options = [d[g][0] for k, d in by_technique.items() if k.startswith("-") and g in d]
    if plain is not None and options:
      gains.append(f"{max(options) - plain[0]:+.2f} at G = {g}")
  # Like for like: an option run in both modes, the aligned runs against the fine-grained run
  # with the same option (does it close the structure's gap, or lift both modes alike?).
  alike = []
  for suffix in sorted(k for k in by_technique if k.startswith("-")):
    against = [
      f"G = {g} {delta[0]:+.2f} ({delta[1]})"
      for g in (1, 8)
      if (delta := _mean_delta(runs, f"aligned-g{g}{suffix}", f"clicktrain{suffix}"))
    ]
    if against:
      alike.append(f"`{suffix.lstrip('-')}` {', '.join(against)}")
  losses = [runs[m, 0]["history"][-1]["train_loss"] for m in aligned]
  fine_loss = runs["clicktrain", 0]["history"][-1]["train_loss"]
  lines += [
    "",
    (
      f"Why: every aligned run with G ≤ 8 of this row ends at a training loss of "
      f"{min(losses):.3f}–{max(losses):.3f}, the fine-grained run at {fine_loss:.3f}. At the same "
      "compression the aligned structure (one kept pattern per input channel, shared by a "
      "group's filters) fits the training data less well: the gap is capacity more than the "
      "way into the structure."
      + (
        f" The best transition option moves the accuracy by {' and '.join(gains)} against the "
        "same G's run without options."
        if gains
        else ""
      )
      + (
        " Against the fine-grained run with the same option, the aligned runs with it stand at "
        f"{'; '.join(alike)}."
        if alike
        else ""
      )
      + _underfit_sentence(runs)
    ),
  ]
  return lines


def _underfit_sentence(runs: Mapping[tuple[str, int], Mapping[str, Any]]) -> str:
  """Whether the row's budget lets its networks fit their training data: the dense run's last
  training loss and accuracy against its test accuracy, and the widest train-over-test accuracy
  gap of the seed-0 runs (empty where the runs did not record their training accuracy)."""
  dense = runs.get(("dense", 0))
  seed0 = [r for (_, s), r in runs.items() if s == 0 and "train_acc" in r["history"][-1]]
  if dense is None or "train_acc" not in dense["history"][-1]:
    return ""
  last = dense["history"][-1]
  widest = max(100 * (r["history"][-1]["train_acc"] - r["test_acc"]) for r in seed0)
  gap = (
    "every run's training accuracy is at or below its test accuracy"
    if widest <= 0
    else f"no run's training accuracy is more than {widest:.1f} points above its test accuracy"
  )
  return (
    f" The dense run itself ends at a training loss of {last['train_loss']:.3f} (training "
    f"accuracy over its last epoch, augmented, {100 * last['train_acc']:.1f}%; test "
    f"{100 * dense['test_acc']:.1f}%), and {gap}: at this budget every network underfits, so "
    "what a structure costs in capacity it costs in test accuracy. A recipe that fits its "
    "training data (as a full-length one does) leaves capacity to spare; how much of the gap "
    "remains there is not measured here."
  )


def _fine_lines(
  row: str, runs: Mapping[tuple[str, int], Mapping[str, Any]], reference: float | None
) -> list[str]:
  """The fine-grained runs of ``row``: their mean against the published accuracy ``reference``
  (the target: not more than a point below), and each fine-grained run with transition options
  against the plain one of its seed (empty without fine-grained runs)."""
  accs = [100 * r["test_acc"] for (m, _), r in runs.items() if m == "clicktrain"]
  if not accs:
    return []
  mean = sum(accs) / len(accs)
  lines = [
    "",
    "| row | fine-grained run | mean test acc (seeds) | mean Δ vs fine-grained (seeds) |",
    "|---|---|---:|---:|",
    f"| {row} | clicktrain | {mean:.2f}% ({len(accs)}) | – |",
  ]
  for method in (m for m in _methods(runs) if m.startswith("clicktrain-")):
    own = [100 * r["test_acc"] for (m, _), r in runs.items() if m == method]
    delta = _mean_delta(runs, method)
    lines.append(
      f"| {row} | {method} ({_technique(method.removeprefix('clicktrain'))}) | "
      f"{sum(own) / len(own):.2f}% ({len(own)}) | "
      + (f"{delta[0]:+.2f} ({delta[1]}) |" if delta else "– |")
    )
  if reference is not None:
    met = mean >= reference - 1.0
    lines += [
      "",
      f"The fine-grained mean, {mean:.2f}% over {len(accs)} seed(s), against the "
      f"{reference:.1f}% published before the transition options (target: not more than 1 "
      f"point below): {'met' if met else 'not met'}.",
    ]
  return lines


def _dense_epoch_s(run: Mapping[str, Any], default_at: int | None) -> float | None:
  """The run's own dense-speed epoch: its mean epoch before the hard prune (a dense run: over
  all its epochs but the first), the unit that makes runs under other machine loads
  comparable."""
  at = pruned_at(run) or default_at
  if run.get("method") == "dense" or not at:
    at = run["history"][-1]["epoch"]
  return _epoch_s(run, at, False)


def _cost_curve(run: Mapping[str, Any], unit: float) -> tuple[list[float], list[float]]:
  """Cumulative training time in dense epochs (epoch times, evaluation excluded) and the test
  accuracy after each epoch."""
  cost, xs, ys = 0.0, [], []
  for record in run["history"]:
    cost += record["epoch_time_s"] / unit
    if "test_acc" in record:
      xs.append(cost)
      ys.append(100 * record["test_acc"])
  return xs, ys


def _time_lines(
  row: str, runs: Mapping[tuple[str, int], Mapping[str, Any]], figure: Path
) -> list[str]:
  """The time-to-accuracy table of ``row``'s seed-0 runs, and the figure of the dense, the
  fine-grained and the most accurate aligned run at G = 1 and at 1 < G <= 8 (to ``figure``)."""
  default_at = _row_prune_epoch(runs)
  seed0 = {m: r for (m, s), r in runs.items() if s == 0}
  units = {m: _dense_epoch_s(r, default_at) for m, r in seed0.items()}
  dense_cost = _cost_curve(seed0["dense"], units["dense"])[0][-1]
  lines = [
    "| row | method | test acc | wall time (s) | dense epoch (s) | cost in dense epochs "
    "| cost / dense run's |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  for method in _methods({(m, 0): r for m, r in seed0.items()}):
    r, unit = seed0[method], units[method]
    cost = _cost_curve(r, unit)[0][-1]
    lines.append(
      f"| {row} | {method} | {100 * r['test_acc']:.2f}% | {r['wall_time_s']:.0f} | {unit:.0f} | "
      f"{cost:.2f} | {cost / dense_cost:.2f}× |"
    )
  aligned = [m for m in seed0 if m.startswith("aligned")]
  best = [
    max(group, key=lambda m: seed0[m]["test_acc"])
    for group in (
      [m for m in aligned if _aligned_order(m)[0] == 1],
      [m for m in aligned if 1 < _aligned_order(m)[0] <= 8],
    )
    if group
  ]
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for method in [m for m in ("dense", "clicktrain") if m in seed0] + best:
    ax.plot(*_cost_curve(seed0[method], units[method]), marker="o", ms=3, label=method)
  ax.set_xlabel("cumulative training time (dense epochs of the same run)")
  ax.set_ylabel("test accuracy (%)")
  ax.set_title(f"{row}: test accuracy against training time")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(figure, dpi=110)
  plt.close(fig)
  return [*lines, "", f"![{row}: test accuracy against training time]({figure.name})"]


def aligned_markdown(
  folder: Path,
  budget: str,
  tag: str,
  paper: Mapping[str, Sequence[float]],
  rows: Sequence[str],
  notes: Sequence[str] = (),
) -> str:
  """The aligned mode's page; writes each row's time-to-accuracy figure beside it in ``folder``
  (``table1-aligned_<tag>_<row>_time.png``).

  Args:
    folder: where the runs' JSON files are.
    budget: the budget's name, as the page states it.
    tag: the budget part of the file names (the budget, with the dtype's marker).
    paper: Table 1's rows, ``row -> (base acc, Δ, compression, ...)``, for the paper's line.
    rows: the rows to look for, in page order.
    notes: lines placed under the title (the dtype's notes).

  Returns:
    The page: one line per seed-0 run of each row that has aligned runs and a dense run, the
    seeds table below where some row was run under other seeds, and every run's command.
  """
  lines = [f"# ClickTrain's aligned mode at the `{budget}` budget (beyond the paper)", ""]
  if notes:
    lines += [*notes, ""]
  lines += [
    (
      f"Each row's runs share the budget and seed of Table 1's rows (`table1_{tag}.md`); "
      "`aligned-gG` is `clicktrain(..., filter_groups=G)` with the pruned convs switched to the "
      "aligned layers after the hard prune (`SparseExecution`, each layer kept where it measures "
      "faster); `aligned-gGc` the same with `filter_grouping=\"clustered\"` (groups of filters "
      "whose Eq. 2 and pattern scores agree, chosen when the patterns are finalized). A suffix "
      "marks the transition options beyond the paper (`docs/design.md`, aligned mode): `-rampc` "
      "/ `-rampl` the group lasso's coefficient grown cubically / linearly over the regularize "
      "stage (`--group-lasso-ramp`), `-winN` a soft hard prune over the last N epochs before it "
      "(`--prune-window-epochs`), `-rwE` learning-rate rewinding to epoch E after it "
      "(`--lr-rewind-epoch`), `-hpE` the hard prune after epoch E instead of the budget's "
      "(`--hard-prune-epoch`); a row without a suffix is the same run without them, and "
      "`clicktrain-<suffix>` the fine-grained run with them. Runs of one seed made by "
      "different versions of the code part from the first epoch (their random streams differ) "
      "and can differ by a point at the end; runs of one version agree until their methods do "
      "(the results index compares the transition options with runs re-made on their version). "
      "The paper "
      "has no aligned mode: its row is the fine-grained ClickTrain of Table 1 at the full recipe "
      f"(190 epochs), ours the `{budget}` recipe. Compression counts every conv weight. Epoch "
      "times are means over one run's epochs before the hard prune (from the second: the first "
      "compiles) and after it (the first of those measures the layers and compiles the new step); "
      "their ratio compares a run with itself, so runs made under different machine load stay "
      "comparable. Three read-outs say where accuracy goes: the test accuracy evaluated at the "
      "end of the hard prune's epoch (BatchNorm statistics re-estimated after the masks; at a "
      "budget that evaluates every few epochs, the last evaluation before it), the "
      "share of the pruned layers' squared weight norm the prune removes (read just before it; "
      "small when the group lasso has done its job; – for runs that did not record it), and the "
      "train loss of the last epoch (a pruned network that fits its training data less well "
      "lost capacity, not generalization)."
    ),
    "",
    (
      "| row | method | test acc | Δ vs dense | Δ vs fine-grained | compression "
      "| test acc at the prune (last evaluation) | norm the prune removes | last train loss "
      "| epoch s before / after the prune | after / before |"
    ),
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  seeds, targets, times, commands = [], [], [], []
  for row in rows:
    runs = _saved_runs(folder, tag, row)
    if not any(m.startswith("aligned") for m, _ in runs) or ("dense", 0) not in runs:
      continue
    if row in paper:
      base, delta, compression = paper[row][:3]
      lines.append(
        f"| {row} | paper: ClickTrain (fine-grained, 190 epochs) | {base + delta:.1f}% | "
        f"{delta:+.1f} | – | {compression:.1f}× | – | – | – | – | – |"
      )
    lines += _run_lines(row, runs)
    seeds += _seed_lines(row, runs)
    row_targets = _target_lines(row, runs, FINE_REFERENCE.get((budget, row)))
    if row_targets:
      targets += [*row_targets, ""]
    times += [*_time_lines(row, runs, folder / f"table1-aligned_{tag}_{row}_time.png"), ""]
    for seed in sorted({s for _, s in runs}):
      for method in (m for m in _methods(runs) if (m, seed) in runs):
        name = method + (f" seed {seed}" if seed else "")
        run = runs[method, seed]
        # A run's own caveat (e.g. epochs timed under other jobs' load) goes with its command.
        note = f" ({run['note']})" if run.get("note") else ""
        commands.append(f"- {row} {name}: `{run.get('command', '')}`{note}")
  if seeds:
    lines += [
      "",
      "## Over seeds",
      "",
      (
        "The same runs under other `--seed`s (initialisation, data order and the balanced "
        "subsets all follow the seed). The mean difference to the fine-grained run is taken "
        "seed by seed, over the seeds (count in brackets) that have both runs."
      ),
      "",
      *seeds[:-1],
    ]
  if targets:
    lines += [
      "",
      "## Against the targets",
      "",
      (
        "The aligned mode's targets at the same compression: the best run with G ≤ 8 within "
        f"{TARGETS[0][1]:.0f} point of the fine-grained run, the best with G = 1 within "
        f"{TARGETS[1][1]:.0f}; differences are means over the seeds that have both runs (count "
        "in brackets). Below, each technique's difference at G = 1 and G = 8 (a technique run "
        "at one G only shows –)."
      ),
      "",
      *targets[:-1],
    ]
  if times:
    lines += [
      "",
      "## Time to accuracy",
      "",
      (
        "Each run's training time (the sum of its epoch times; evaluation excluded) in units of "
        "its own dense-speed epoch: the mean of its epochs before the hard prune (the dense "
        "run: all its epochs), which the same machine ran under the same load, so runs made on "
        "other machines or under other load compare. The last column divides by the dense "
        "run's cost. A run whose load changed between its epochs before and after the prune "
        "(its note under Commands) is off by that change. The figure plots the dense, the "
        "fine-grained and the most accurate aligned run at G = 1 and at 1 < G ≤ 8."
      ),
      "",
      *times[:-1],
    ]
  return "\n".join([*lines, "", "Commands:", "", *commands]) + "\n"

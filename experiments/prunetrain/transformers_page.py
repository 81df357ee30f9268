"""The page and figure of :mod:`experiments.prunetrain.transformers` (``transformers.md``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The targets for PruneTrain against dense at the end of the same number of steps.
TARGETS = {
  "params_saved": 0.40,
  "flops_saved": 0.40,
  "val_loss_ratio": 1.02,
  "time_to_dense_loss_ratio": 0.80,
}


def _met(key: str, value: float | None) -> str:
  if value is None:
    return "not reached"
  target = TARGETS[key]
  ok = value >= target if key.endswith("saved") else value <= target
  return "met" if ok else "missed"


def _figure(result: dict[str, Any], path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = result["rows"]
  fig, axes = plt.subplots(1, len(rows), figsize=(4.6 * len(rows), 3.3), squeeze=False)
  for ax, (name, row) in zip(axes[0], rows.items()):
    for method, style in (("dense", "-"), ("prunetrain", "--")):
      records = row["runs"][method]["records"]
      ax.plot(
        [r["train_seconds"] / 60 for r in records],
        [r["val_loss"] for r in records],
        style,
        marker=".",
        label=method,
      )
    for rec in row["runs"]["prunetrain"]["reconfigurations"]:
      seconds = next(
        r["train_seconds"] for r in row["runs"]["prunetrain"]["records"] if r["step"] >= rec["step"]
      )
      ax.axvline(seconds / 60, color="grey", lw=0.5, alpha=0.6)
    ax.set_xlabel("training wall time (min, 2 CPU cores)")
    ax.set_ylabel("validation loss")
    ax.set_title(row["settings"]["title"], fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _pct(x: float) -> str:
  return f"{100 * x:.1f}%"


def _row_section(name: str, row: dict[str, Any]) -> list[str]:
  s, summary = row["settings"], row["summary"]
  dense, pruned = row["runs"]["dense"]["records"], row["runs"]["prunetrain"]["records"]
  d, p = dense[-1], pruned[-1]
  unit = "images/s" if s["example"] == "images" else "tokens/s"
  speed = f"{s['example']}_per_second"
  lines = [
    f"## {s['title']}",
    "",
    f"- Model: `{json.dumps(s['model'])}`; {s['steps']} steps at batch {s['batch_size']}, "
    f"AdamW (lr {s['lr']}, {s['warmup']} warm-up steps, cosine to 0, weight decay "
    f"{s['weight_decay']}), seed {s['seed']}.",
    f"- PruneTrain: penalty ratio {s['penalty_ratio']} (Eq. 3), dead when max|w| < "
    f"{s['threshold']:g}, a reconfiguration every {s['interval']} steps.",
    f"- Data: `{json.dumps(s['data'])}`.",
    f"- Run {row['date']}: `{row['command']}`",
    "",
    "| | dense | PruneTrain | PruneTrain / dense | target |",
    "|---|---:|---:|---:|---|",
    f"| parameters | {d['params']:,} | {p['params']:,} | {_pct(1 - summary['params_saved'])} | "
    f"≥ 40% fewer: {_met('params_saved', summary['params_saved'])} |",
    f"| inference FLOPs / example | {d['flops'] / 1e6:.2f}M | {p['flops'] / 1e6:.2f}M | "
    f"{_pct(1 - summary['flops_saved'])} | ≥ 40% fewer: "
    f"{_met('flops_saved', summary['flops_saved'])} |",
    f"| final validation loss | {d['val_loss']:.4f} | {p['val_loss']:.4f} | "
    f"{summary['val_loss_ratio']:.3f} | ≤ 1.02: {_met('val_loss_ratio', summary['val_loss_ratio'])} |",
  ]
  if s["example"] == "images":
    lines.append(
      f"| final validation accuracy | {_pct(d['val_acc'])} | {_pct(p['val_acc'])} | "
      f"{100 * (p['val_acc'] - d['val_acc']):+.2f} points | |"
    )
  reach = summary["time_to_dense_loss_ratio"]
  lines += [
    f"| training wall time | {d['train_seconds'] / 60:.1f} min | {p['train_seconds'] / 60:.1f} "
    f"min | {summary['train_seconds_ratio']:.2f} | |",
    f"| time to dense's final loss | {d['train_seconds'] / 60:.1f} min | "
    + (f"{reach * d['train_seconds'] / 60:.1f} min" if reach is not None else "not reached")
    + f" | {'–' if reach is None else f'{reach:.2f}'} | ≤ 0.8: "
    f"{_met('time_to_dense_loss_ratio', reach)} |",
    "",
    f"Throughput ({unit}, training steps only) and size, before and after each reconfiguration:",
    "",
    "| step | params | FLOPs / example | attention widths after (q, k columns) | removed branches "
    f"| {unit} before | {unit} after |",
    "|---:|---:|---:|---|---|---:|---:|",
  ]
  for rec in row["runs"]["prunetrain"]["reconfigurations"]:
    before = [r for r in pruned if r["step"] <= rec["step"]]
    after = [r for r in pruned if r["step"] > rec["step"]]
    widths = ", ".join(
      f"{k.split('/')[1]}.{k.split('/')[-1]}={v}"
      for k, v in rec["widths"].items()
      if k.endswith(("/q", "/k"))
    )
    lines.append(
      f"| {rec['step']} | {rec['params'][0]:,} → {rec['params'][1]:,} | "
      f"{rec['flops'][0] / 1e6:.2f}M → {rec['flops'][1] / 1e6:.2f}M | {widths} | "
      f"{', '.join(rec['removed_branches']) or '–'} | "
      f"{before[-1][speed]:,.0f} | " + (f"{after[0][speed]:,.0f}" if after else "–") + " |"
    )
  recs = row["runs"]["prunetrain"]["reconfigurations"]
  if not recs:
    lines.append("| – | no group died | | | | | |")
  else:
    query = sum(v for k, v in recs[-1]["widths"].items() if k.endswith("/q"))
    heads = query // s["model"]["head_dim"]
    total = s["model"]["num_heads"] * s["model"]["depth"]
    lines += [
      "",
      f"Query heads at the end: {heads} of {total}"
      + (" (no head died: the groups that went are MLP units)." if heads == total else "."),
      f"The first record after a reconfiguration includes the recompilation of the step at the "
      f"new widths, so its {unit} read low.",
    ]
  lines += [
    "",
    f"Dense {unit} over the run: {dense[len(dense) // 2][speed]:,.0f} (mid-run record).",
    "",
    *_gap_readout(row),
  ]
  return lines


def _gap_readout(row: dict[str, Any]) -> list[str]:
  """Where the validation-loss gap opens: PruneTrain / dense at the last record before the first
  reconfiguration (the penalty alone), after each one and at the end; and how much dense still
  gained over the last quarter of the steps (a model still learning pays for what it loses)."""
  dense = {r["step"]: r["val_loss"] for r in row["runs"]["dense"]["records"]}
  pruned = {r["step"]: r["val_loss"] for r in row["runs"]["prunetrain"]["records"]}
  steps = sorted(set(dense) & set(pruned))
  if not steps:
    return []
  recs = row["runs"]["prunetrain"]["reconfigurations"]
  first = recs[0]["step"] if recs else steps[-1]
  before = [t for t in steps if t <= first]
  marks = ([before[-1]] if before else []) + [
    next((t for t in steps if t > r["step"]), steps[-1]) for r in recs
  ]
  marks = sorted(set(marks) | {steps[-1]})
  alone = before[-1] if before and recs else None
  ratios = ", ".join(
    f"×{pruned[t] / dense[t]:.3f} at step {t}"
    + (" (before the first removal: the penalty alone)" if t == alone else "")
    for t in marks
  )
  quarter = next(t for t in steps if t >= 0.75 * steps[-1])
  gain = 1 - dense[steps[-1]] / dense[quarter]
  lines = [
    f"Validation loss, PruneTrain / dense: {ratios}; after each reconfiguration, the first "
    "record that follows it.",
    f"Dense's validation loss fell {_pct(gain)} from step {quarter} to the end, the last quarter "
    "of the steps"
    + (
      ": the model is still learning when the run stops, so the capacity PruneTrain takes is "
      "capacity dense is still using."
      if gain > 0.01
      else ": a plateau."
    ),
    "",
  ]
  return lines


def write_page(stem: Path, result: dict[str, Any]) -> None:
  """Writes ``<stem>.json``, ``<stem>.md`` and the figure ``<stem>_loss.png``."""
  stem = Path(stem)
  # Not with_suffix: a probe's stem holds its ratio ("transformers_r0.5").
  stem.parent.joinpath(f"{stem.name}.json").write_text(json.dumps(result, indent=1))
  figure = stem.parent / f"{stem.name}_loss.png"
  _figure(result, figure)
  lines = [
    "# PruneTrain on transformers: heads and MLP units removed while training",
    "",
    "Dense against PruneTrain at the same number of steps, from the same initialisation and data "
    "order. PruneTrain's group lasso penalises the groups the traced channel graph finds (whole "
    "attention heads with head_dim kept, grouped-query kv heads with their query heads, MLP "
    "units); every reconfiguration removes the dead ones from the model and AdamW's moments. "
    "The residual stream stays: the norms take a statistic over it. Wall time counts training "
    "only (evaluations left out), reconfigurations and recompilations included.",
    "",
    f"Machine: {result['machine']}. Regenerate: "
    "`python -m experiments.run prunetrain_transformers --publish`.",
    "",
    f"![validation loss against wall time]({figure.name})",
    "",
  ]
  for name, row in result["rows"].items():
    lines += _row_section(name, row)
  lines += _probes(stem)
  stem.parent.joinpath(f"{stem.name}.md").write_text("\n".join(lines))


def _probes(stem: Path) -> list[str]:
  """The probes' runs (``probes/<stem>_r<ratio>[_s<steps>].json``: another penalty ratio or
  length), one line each."""
  found = sorted((stem.parent / "probes").glob(f"{stem.name}_*.json"))
  if not found:
    return []
  lines = [
    "## Other penalty ratios and lengths (probes)",
    "",
    "The same rows at another ratio or number of steps (`--penalty-ratio R`, `--steps N`, "
    "written to `probes/transformers_rR_sN.*`).",
    "",
    "| row | ratio | steps | params saved | FLOPs saved | val loss / dense "
    "| time to dense's loss / dense's |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for path in found:
    for name, row in json.loads(path.read_text())["rows"].items():
      s = row["summary"]
      reach = s["time_to_dense_loss_ratio"]
      lines.append(
        f"| {row['settings']['title']} | {row['settings']['penalty_ratio']} | "
        f"{row['settings']['steps']} | "
        f"{_pct(s['params_saved'])} | {_pct(s['flops_saved'])} | {s['val_loss_ratio']:.3f} | "
        + ("not reached" if reach is None else f"{reach:.2f}")
        + " |"
      )
  return lines + [""]

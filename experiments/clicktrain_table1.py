"""ClickTrain Table 1 (CIFAR-10 rows): dense baseline vs ClickTrain, beside the paper.

Rows: the clicktrain family's ResNet-32 (4-stage BasicBlock, 64-512), ResNet-50,
VGG-11 and VGG-13 (and ResNet-18, not in Table 1, as a cheap stand-in for the
CPU budget run; it uses ResNet-32's per-stage ratios). The full recipe is the paper's (§6.1): 190 epochs, batch 128,
SGD momentum 0.9, lr 0.1 (x0.1 at 50% / 75% of the run: the paper does not state
its schedule), weight decay 5e-4, λ = 2.5e-4, stage-2 trigger = loss derivative
0.27, pool of 12 patterns, hard prune at the paper's epoch for the row, per-layer
kernel-prune ratios from the authors' released code: ResNet-32 55 / 65 / 75% by
stage; VGG-11 35, 45, 65, 75, 80, 80, 85%. ResNet-50 and VGG-13 ratios are not
published; we use ResNet-32's by stage and VGG-11's stretched to 9 layers
(35, 40, 45, 55, 65, 75, 80, 80, 85%).

``--budget`` is the reduced CPU mode, the same budget for every row: width x1/4,
a 10k-image training subset, a 2k-image test subset, ``--epochs`` (default 6)
epochs, stages at fixed epochs scaled to the run (warmup 1, DPPG 1, finalize 1,
regularize until 60% of the run, then hard pruned), pool of 12. It shows the
machinery and the compression / FLOPs columns; the accuracies are far from
converged and are not comparable to the paper's.

Writes ``experiments/results/clicktrain_table1[_budget]_<rows>.md``, per-row
``clicktrain_table1[_budget]_<row>_<method>.json``, per-epoch
JSON lines, and PNG plots of the final pattern pool (usage counts) and per-layer
sparsity:

    python -m experiments.run clicktrain_table1 --rows vgg11 --budget --epochs 15 \
        --linear-init-std 0.05                   # the VGG-11 run reported in results/
    python -m experiments.run clicktrain_table1 --rows resnet18 --budget --width 0.125 \
        --train-subset 5000 --batch-size 64      # the run reported in results/
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

import jaxprune
from experiments._machine import machine_description
from jaxprune import data, flops, models, train
from jaxprune.clicktrain import patterns, readouts

RESULTS = Path(__file__).resolve().parent / "results"

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
VGG_RATIOS = {
  "vgg11": [0.35, 0.45, 0.65, 0.75, 0.80, 0.80, 0.85],
  "vgg13": [0.35, 0.40, 0.45, 0.55, 0.65, 0.75, 0.80, 0.80, 0.85],
}


def kernel_ratio_fn(row: str):
  """Per-layer kernel-prune ratio as ``fn(path, shape)`` for a Table 1 row."""
  if row.startswith("vgg"):
    ratios = VGG_RATIOS[row]

    def by_index(path: str, shape) -> float:
      # features/<i>/conv/kernel; the stem (index 0) is never pruned
      return ratios[int(path.split("/")[1]) - 1]

    return by_index

  def by_stage(path: str, shape) -> float:
    stage = int(path.split("/")[1])  # stages/<s>/<block>/...
    return (0.55, 0.65)[stage] if stage < 2 else 0.75

  return by_stage


def _parse(argv):
  p = argparse.ArgumentParser(prog="clicktrain_table1", description=__doc__.splitlines()[0])
  p.add_argument("--rows", default="vgg11", help="comma list of resnet32,resnet50,vgg11,vgg13")
  p.add_argument("--budget", action="store_true", help="reduced CPU mode (see module doc)")
  p.add_argument("--epochs", type=int, default=None, help="default 190, or 6 with --budget")
  p.add_argument("--width", type=float, default=None, help="default 1, or 0.25 with --budget")
  p.add_argument("--train-subset", type=int, default=None)
  p.add_argument("--test-subset", type=int, default=None)
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument("--mode", default="paper", choices=["paper", "one_shot"])
  p.add_argument("--skip-dense", action="store_true")
  p.add_argument("--root", default=None)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--linear-init-std",
    type=float,
    default=None,
    help="std of the VGG classifier's normal init (default: the model's, ClickTrain's 0.01)",
  )
  a = p.parse_args(argv)
  if a.budget:
    a.epochs = a.epochs or 6
    a.width = a.width or 0.25
    a.train_subset = a.train_subset or 10_000
    a.test_subset = a.test_subset or 2_000
  else:
    a.epochs = a.epochs or 190
    a.width = a.width or 1.0
  return a


def _schedule(args, row: str) -> dict[str, Any]:
  if args.budget:
    e = args.epochs
    hard = max(4, round(0.6 * e))
    return dict(
      pool_start_epoch=1, pool_epochs=1, finalize_epochs=1, hard_prune_epoch=hard, one_shot_epoch=1
    )
  hard = PAPER[row][5] if row in PAPER else round(0.5 * args.epochs)
  return dict(
    pool_start_epoch=None,
    pool_epochs=5,
    finalize_epochs=5,
    hard_prune_epoch=hard,
    one_shot_epoch=hard - 30,
  )


def _run(args, row: str, prune: bool, train_set, test_set) -> dict[str, Any]:
  label = "clicktrain" if prune else "dense"
  stem = f"clicktrain_table1{'_budget' if args.budget else ''}_{row}_{label}"
  loader = data.Loader(
    train_set, args.batch_size, shuffle=True, seed=args.seed, augment="clicktrain", drop_last=True
  )
  test_loader = data.Loader(
    test_set, min(500, len(test_set.labels)), shuffle=False, drop_last=False
  )
  spe = len(loader)
  milestones = [max(1, round(0.5 * args.epochs)), max(2, round(0.75 * args.epochs))]
  inner = train.sgd(train.step_schedule(0.1, spe, milestones), momentum=0.9, weight_decay=5e-4)
  overrides = {}
  if args.linear_init_std is not None:
    if not row.startswith("vgg"):
      raise ValueError(f"--linear-init-std applies to the VGG rows only, not {row!r}")
    overrides["linear_init_std"] = args.linear_init_std
  model = models.create(
    f"clicktrain-{row}",
    num_classes=10,
    rngs=nnx.Rngs(args.seed),
    width_multiplier=args.width,
    **overrides,
  )
  sched = _schedule(args, row)
  if prune:
    kw = dict(sched)
    if args.mode == "paper":
      kw.pop("one_shot_epoch")
    else:
      kw = dict(hard_prune_epoch=kw["hard_prune_epoch"], one_shot_epoch=kw["one_shot_epoch"])
    tx = jaxprune.clicktrain.clicktrain(
      inner, steps_per_epoch=spe, mode=args.mode, kernel_prune_ratio=kernel_ratio_fn(row), **kw
    )
    metrics = {
      "stage": lambda t: readouts.stage_name(t.opt_state),
      "compression": lambda t: flops.compression_ratio(t.params),
    }
  else:
    tx, metrics = inner, {"compression": lambda t: flops.compression_ratio(t.params)}
  trainer = train.Trainer(
    model, tx, metrics=metrics, log_path=RESULTS / f"{stem}.jsonl", progress=False
  )
  if prune and args.mode == "one_shot":
    # The released code switches to mixup (α = 0.3) after the hard prune.
    trainer.fit(loader, test_loader, epochs=sched["hard_prune_epoch"])
    loader = data.Loader(
      train_set,
      args.batch_size,
      shuffle=True,
      seed=args.seed,
      augment="clicktrain-mixup",
      drop_last=True,
    )
  history = trainer.fit(loader, test_loader, epochs=args.epochs)
  result = {
    "row": row,
    "method": label,
    "test_acc": history[-1]["test_acc"],
    "compression": flops.compression_ratio(trainer.params),
    "wall_time_s": history[-1]["wall_time_s"],
    "history": history,
  }
  if prune:
    st = trainer.opt_state
    saved = readouts.flops_saved(trainer.model, st, (1, 32, 32, 3))
    result.update(
      stage=readouts.stage_name(st),
      flops_saved=saved,
      layer_sparsity=_layer_sparsity(trainer.params),
      pattern_usage={
        int(k): [v[0].tolist(), v[1].tolist()] for k, v in readouts.pattern_usage(st).items()
      },
      pool=[
        int(i) for i in next((ls.pool for ls in st.layers.values() if ls.pool is not None), [])
      ],
    )
    _plots(result, RESULTS / f"{stem}")
  (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2, default=float))
  return result


def _layer_sparsity(params) -> dict[str, float]:
  """Fraction of exactly-zero weights per conv layer (after the hard prune: the masks)."""
  out = {}
  for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
    if np.ndim(w) == 4:
      name = "/".join(str(getattr(k, "key", k)) for k in path[:-1])
      out[name] = float(np.mean(np.asarray(w) == 0))
  return out


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
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  machine = machine_description()
  mode = (
    f"reduced budget: width x{args.width}, {args.train_subset} train / {args.test_subset} "
    f"test images, {args.epochs} epochs"
    if args.budget
    else f"full recipe, {args.epochs} epochs"
  )
  lines = [
    f"# ClickTrain Table 1 (CIFAR-10), {mode}",
    "",
    f"- Command: `{command}`",
    f"- Date: {date}",
    f"- Machine: {machine}",
    f"- ClickTrain mode: `{args.mode}`; data: the JPEG re-encoded CIFAR-10 (accuracies a little "
    "under published numbers).",
    *(
      [
        f"- VGG classifier init: N(0, {args.linear_init_std}) instead of the paper's N(0, 0.01): "
        "at reduced width the std-0.01 3-layer MLP keeps the loss at ln 10 for the first "
        "hundreds of steps, longer than the budget; dense and ClickTrain rows use the same init."
      ]
      if args.linear_init_std is not None
      else []
    ),
    *(
      [
        "- Budget runs are far from converged: compare dense vs ClickTrain within this table, "
        "not with the paper's accuracy columns."
      ]
      if args.budget
      else []
    ),
    "",
    "| model | method | base acc | acc | Δ | comp. ratio | train / inf FLOPs saved | "
    "hard-prune epoch | paper (CLK): base, Δ, ratio, FLOPs saved, epoch | paper PruneTrain Δ, ratio |",
    "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
  ]
  for row, res in results.items():
    if row in PAPER:
      p = PAPER[row]
      paper = f"{p[0]}%, {p[1]:+.1f}%, {p[2]}x, {p[3]}% / {p[4]}%, {p[5]}"
      prt = f"{PRUNETRAIN[row][0]:+.1f}%, {PRUNETRAIN[row][1]}x"
    else:
      paper = prt = "n/a (not a Table 1 row)"
    dense = res.get("dense")
    base = f"{100 * dense['test_acc']:.2f}%" if dense else "—"
    if dense:
      lines.append(
        f"| {row} | dense | {base} | {base} | 0 | {dense['compression']:.2f}x | — | — "
        f"| {paper} | {prt} |"
      )
    clk = res.get("clicktrain")
    if clk:
      delta = f"{100 * (clk['test_acc'] - dense['test_acc']):+.2f}%" if dense else "—"
      fs = clk["flops_saved"]
      lines.append(
        f"| {row} | ClickTrain | {base} | {100 * clk['test_acc']:.2f}% | {delta} "
        f"| {clk['compression']:.2f}x | {100 * fs['training']:.1f}% / {100 * fs['inference']:.1f}% "
        f"| {_schedule(args, row)['hard_prune_epoch']} | {paper} | {prt} |"
      )
  lines += [
    "",
    "FLOPs saved are per step once hard-pruned (sparse conv accounting of "
    "`jaxprune.flops`: pruned weights skipped in forward and both backward convs). The "
    "paper's training column averages over the whole run.",
    "",
  ]
  prefix = "clicktrain_table1_budget" if args.budget else "clicktrain_table1"
  for row, res in results.items():
    clk = res.get("clicktrain")
    if clk:
      lines += [
        f"## {row}: pattern pool and per-layer sparsity",
        "",
        f"- final stage: {clk['stage']}; pool (ids into `all_patterns(4, 3)`, most "
        f"competitive first): {clk['pool']}",
        f"- patterns used by kept kernels (id: count): "
        + ", ".join(f"{i}: {c}" for i, c in zip(*clk['pattern_usage'].get(3, [[], []]))),
        f"- ![patterns]({prefix}_{row}_clicktrain_patterns.png)",
        f"- ![sparsity]({prefix}_{row}_clicktrain_sparsity.png)",
        "",
        "| layer | zero weights |",
        "|---|---:|",
      ]
      lines += [f"| {k} | {100 * v:.1f}% |" for k, v in clk["layer_sparsity"].items()]
      lines.append("")
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  command = "python -m experiments.run clicktrain_table1 " + shlex.join(
    list(argv) if argv is not None else sys.argv[1:]
  )
  rows = [r.strip() for r in args.rows.split(",") if r.strip()]
  for r in rows:
    if r not in PAPER and r not in EXTRA_ROWS:
      raise ValueError(f"--rows: unknown row {r!r}; choose from {sorted(PAPER) + list(EXTRA_ROWS)}")
  RESULTS.mkdir(parents=True, exist_ok=True)
  train_set = data.load("cifar10", root=args.root, split="train")
  test_set = data.load("cifar10", root=args.root, split="test")
  if args.train_subset:
    train_set = train_set.subset(
      np.random.default_rng(args.seed).permutation(len(train_set.labels))[: args.train_subset]
    )
  if args.test_subset:
    # the test set is stored class by class: a random subset keeps every class
    test_set = test_set.subset(
      np.random.default_rng(args.seed + 1).permutation(len(test_set.labels))[: args.test_subset]
    )
  results: dict[str, dict[str, Any]] = {}
  # one markdown per set of rows, so a run of other rows does not overwrite it
  out = RESULTS / f"clicktrain_table1{'_budget' if args.budget else ''}_{'_'.join(rows)}.md"
  for row in rows:
    results[row] = {}
    for prune in (True,) if args.skip_dense else (False, True):
      res = _run(args, row, prune, train_set, test_set)
      results[row]["clicktrain" if prune else "dense"] = res
      out.write_text(_markdown(args, results, command))
      print(
        f"{row} {res['method']}: acc {100 * res['test_acc']:.2f}% "
        f"compression {res['compression']:.2f}x",
        flush=True,
      )
  return {
    r: {k: {kk: vv for kk, vv in v.items() if kk != "history"} for k, v in res.items()}
    for r, res in results.items()
  }


if __name__ == "__main__":
  main()

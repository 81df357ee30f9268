"""PruneTrain on transformers: a ViT on CIFAR-10 and a byte-level language model, dense against
PruneTrain over heads and MLP units, at the same number of steps.

Each row trains the dense model and the PruneTrain model from the same initialisation and data
order, with AdamW (warm-up, then cosine decay). PruneTrain adds the channel group lasso over the
groups the traced channel graph finds (attention heads, grouped-query kv heads with their query
heads, MLP units; the residual stream is blocked by the norms) and reconfigures the model every
``--interval`` steps (:func:`jaxprune.prunetrain.reconfigure`, AdamW's moments sliced with the
heads). Every ``--eval-every`` steps both record the validation loss (and accuracy), parameters,
inference FLOPs per example, and the training throughput since the last record; the wall time
counts training only (steps, reconfigurations and the recompilations they cause), not the
evaluations.

- ``vit``: CIFAR-10 (the shipped JPEGs), a balanced training subset, the whole test set.
- ``lm``: the bytes of this Python's standard-library sources (``*.py`` files under
  ``sysconfig.get_paths()["stdlib"]``, tests and site-packages left out; read from disk, never
  downloaded). Every tenth file, in sorted order, is held out for validation.

    python -m experiments.run prunetrain_transformers            # both rows, about 25 min on 2 cores
    python -m experiments.run prunetrain_transformers --publish  # results/prunetrain/transformers.md
    python -m experiments.run prunetrain_transformers --page-only --publish  # the page, from its JSON
    python -m experiments.run prunetrain_transformers --rows lm --penalty-ratio 0.25 --publish  # a probe

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.common import cli, pages
from experiments.common.machine import machine_description
from experiments.prunetrain.transformers_page import write_page
from jaxprune import data
from jaxprune import prunetrain as pt
from jaxprune.models.transformer import DecoderLM, ViT

ROWS = ("vit", "lm")
_METHODS = ("dense", "prunetrain")


@dataclasses.dataclass(frozen=True)
class Row:
  """One model of the page and how it trains (the same for its dense and PruneTrain runs)."""

  name: str
  title: str
  steps: int
  batch_size: int
  lr: float
  warmup: int
  weight_decay: float
  example: str  # what one example is: "images" or "tokens"


_ROWS = {
  "vit": Row("vit", "ViT on CIFAR-10", 1200, 128, 2e-3, 100, 0.05, "images"),
  "lm": Row("lm", "byte LM on the standard library's sources", 1200, 16, 2e-3, 100, 0.05, "tokens"),
}
_CONTEXT = 128
_VIT = dict(dim=64, depth=4, num_heads=4, head_dim=16, mlp_hidden=256, patch=4)
_LM = dict(
  context=_CONTEXT, dim=64, depth=4, num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden=256
)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="prunetrain_transformers", description=__doc__.split("\n")[0]
  )
  parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
  parser.add_argument("--steps", type=int, default=None, help="train steps (default: the row's)")
  parser.add_argument("--interval", type=int, default=200, help="steps between reconfigurations")
  parser.add_argument("--eval-every", type=int, default=100, help="steps between records")
  # The paper's 0.2 is for SGD over ~10^5 steps. Under AdamW in 1 200 steps a ViT probe had
  # lost 959 of its 1 040 head / unit groups by step 300 at 0.9 (5% on the validation loss);
  # over the whole run 0.75 removed more than 0.5 and cost 4.7% of the ViT's validation loss
  # against 0.5's 1.7% (the page's probes), so 0.5 it is.
  parser.add_argument(
    "--penalty-ratio", type=float, default=0.5, help="PruneTrain's penalty ratio (Eq. 3)"
  )
  parser.add_argument(
    "--threshold", type=float, default=1e-3, help="dead-group threshold, max|w| (absolute)"
  )
  parser.add_argument("--train-images", type=int, default=10_000, help="ViT's training subset")
  parser.add_argument("--train-bytes", type=int, default=4 << 20, help="LM's training bytes")
  parser.add_argument("--val-windows", type=int, default=256, help="LM's validation windows")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--root", default=None, help="CIFAR-10 source (default: data package's)")
  parser.add_argument(
    "--page-only", action="store_true", help="rewrite the page from its saved runs; train nothing"
  )
  cli.add_output_arguments(parser, "prunetrain/")
  args = parser.parse_args(argv)
  args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
  for r in args.rows:
    if r not in ROWS:
      parser.error(f"--rows: unknown row {r!r}; choose from {', '.join(ROWS)}")
  if args.steps is not None and args.steps < 1:
    parser.error("--steps must be >= 1")
  if args.interval < 1 or args.eval_every < 1:
    parser.error("--interval and --eval-every must be >= 1")
  if not 0.0 < args.penalty_ratio < 1.0 or not args.threshold >= 0.0:
    parser.error("--penalty-ratio must be in (0, 1) and --threshold >= 0")
  return args


# -- data ------------------------------------------------------------------------------------------
def stdlib_sources() -> tuple[list[str], str]:
  """The standard library's ``*.py`` files (relative paths, sorted) and the folder they are in.

  Tests (``test``/``tests`` folders, ``test_*.py``), ``site-packages`` and ``idlelib`` are left
  out: what is left is library code, the same on every machine with this Python version.
  """
  root = Path(sysconfig.get_paths()["stdlib"])
  skip = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__"}
  files = sorted(
    str(p.relative_to(root))
    for p in root.rglob("*.py")
    if not skip & set(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_")
  )
  if not files:
    raise ValueError(f"no standard-library sources under {root}")
  return files, str(root)


def stdlib_bytes(train_bytes: int) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
  """Training and validation bytes of :func:`stdlib_sources`: every tenth file is validation.

  Returns:
    ``(train, val, description)``: uint8 arrays (files joined in sorted order, the training
    bytes cut at ``train_bytes``) and what they are, for the page.
  """
  files, root = stdlib_sources()
  base = Path(root)
  train = b"".join((base / f).read_bytes() for i, f in enumerate(files) if i % 10)
  val = b"".join((base / f).read_bytes() for i, f in enumerate(files) if not i % 10)
  train_all = len(train)
  train = train[:train_bytes]
  described = {
    "python": sys.version.split()[0],
    "files": len(files),
    "train_bytes": len(train),
    "train_bytes_available": train_all,
    "val_bytes": len(val),
  }
  return np.frombuffer(train, np.uint8), np.frombuffer(val, np.uint8), described


def _windows(text: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  idx = starts[:, None] + np.arange(_CONTEXT + 1)[None]
  chunk = text[idx].astype(np.int32)
  return chunk[:, :-1], chunk[:, 1:]


class _LMData:
  """Random training windows (seeded), and fixed non-overlapping validation windows."""

  def __init__(self, train: np.ndarray, val: np.ndarray, val_windows: int, seed: int):
    self.train = train
    starts = np.arange(0, len(val) - _CONTEXT - 1, _CONTEXT + 1)[:val_windows]
    self.val = _windows(val, starts)
    self.rng = np.random.default_rng(seed)
    self.described = {"val_tokens": int(self.val[0].size)}

  def batch(self, size: int) -> tuple[np.ndarray, np.ndarray]:
    return _windows(self.train, self.rng.integers(0, len(self.train) - _CONTEXT - 1, size))

  def val_batches(self):
    for i in range(0, len(self.val[0]), 64):
      yield self.val[0][i : i + 64], self.val[1][i : i + 64]


class _ImageData:
  """CIFAR-10 batches from a :class:`jaxprune.data.Loader` (crop and flip), and the test set."""

  def __init__(self, train: data.Dataset, test: data.Dataset, batch_size: int, seed: int):
    self.loader = data.Loader(train, batch_size, seed=seed, augment="prunetrain")
    self.test = data.Loader(test, 500, shuffle=False, drop_last=False)
    self._it = iter(())
    self.described = {"train_images": len(train), "test_images": len(test)}

  def batch(self, size: int) -> tuple[np.ndarray, np.ndarray]:
    del size  # the loader's, set when it was built
    for _ in range(2):
      batch = next(self._it, None)
      if batch is not None:
        return batch
      self._it = iter(self.loader)
    raise ValueError("the training loader yielded no batch")

  def val_batches(self):
    return iter(self.test)


# -- training --------------------------------------------------------------------------------------
def _loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _schedule(row: Row, steps: int) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(0.0, row.lr, min(row.warmup, steps // 2), steps)


def _step_fn(graphdef: Any, tx: optax.GradientTransformationExtraArgs) -> Callable:
  @jax.jit
  def step(params, rest, opt_state, x, y):
    def loss_fn(p):
      return _loss(nnx.merge(graphdef, p, rest)(x), y)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def _eval_fn(graphdef: Any) -> Callable:
  @jax.jit
  def sums(params, rest, x, y):
    logits = nnx.merge(graphdef, params, rest)(x)
    per = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return per.sum(), (jnp.argmax(logits, -1) == y).sum(), per.size

  return sums


def _evaluate(eval_fn, params, rest, batches) -> dict[str, float]:
  loss = correct = count = 0.0
  for x, y in batches:
    s = eval_fn(params, rest, jnp.asarray(x), jnp.asarray(y))
    loss, correct, count = loss + float(s[0]), correct + float(s[1]), count + float(s[2])
  return {"val_loss": loss / count, "val_acc": correct / count}


def _costs(model: nnx.Module, shape: tuple, dtype: Any) -> dict[str, float]:
  costs = pt.model_costs(model, shape[1:], input_dtype=dtype)
  return {"params": int(costs["params"]), "flops": costs["inference_flops"]}


def _split(model: nnx.Module) -> tuple[Any, Any, Any]:
  """``(graphdef, params, rest)`` with plain arrays (what reconfigure's opt_state is over)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, nnx.as_pure(params), nnx.as_pure(rest)


def _model(row: Row, seed: int) -> nnx.Module:
  if row.name == "vit":
    return ViT(**_VIT, rngs=nnx.Rngs(seed))
  return DecoderLM(**_LM, rngs=nnx.Rngs(seed))


def train_run(
  row: Row, method: str, source: Any, args: argparse.Namespace, steps: int
) -> dict[str, Any]:
  """One training of ``row`` (``method`` "dense" or "prunetrain"); its records."""
  model = _model(row, args.seed)
  shape, dtype = ((1, 32, 32, 3), jnp.float32) if row.name == "vit" else ((1, _CONTEXT), jnp.int32)
  inner = optax.adamw(_schedule(row, steps), weight_decay=row.weight_decay)
  penalised = None
  if method == "prunetrain":
    penalised = pt.penalised_axes(model, shape, input_dtype=dtype)
    tx = pt.with_group_lasso(inner, penalty_ratio=args.penalty_ratio, penalised=penalised)
  else:
    tx = optax.with_extra_args_support(inner)
  graphdef, params, rest = _split(model)
  opt_state = tx.init(params)
  step, evaluate = _step_fn(graphdef, tx), _eval_fn(graphdef)
  costs = _costs(model, shape, dtype)
  per_step = row.batch_size * (1 if row.name == "vit" else _CONTEXT)
  records, reconfigurations = [], []
  train_seconds, since, examples = 0.0, time.perf_counter(), 0
  for i in range(1, steps + 1):
    x, y = source.batch(row.batch_size)
    params, opt_state, loss = step(params, rest, opt_state, jnp.asarray(x), jnp.asarray(y))
    examples += per_step
    if method == "prunetrain" and i % args.interval == 0 and i < steps:
      nnx.update(model, params)
      new_model, new_opt, report = pt.reconfigure(
        model, opt_state, threshold=args.threshold, input_shape=shape, input_dtype=dtype
      )
      if report.changed:
        model, opt_state = new_model, new_opt
        penalised.bind(model, shape)
        graphdef, params, rest = _split(model)
        step, evaluate = _step_fn(graphdef, tx), _eval_fn(graphdef)
        before, costs = costs, _costs(model, shape, dtype)
        reconfigurations.append(
          {
            "step": i,
            "params": [before["params"], costs["params"]],
            "flops": [before["flops"], costs["flops"]],
            "removed_branches": list(report.removed_branches),
            "widths": {k: v for k, v in report.channels_after.items() if "attention" in k},
          }
        )
    if i % args.eval_every == 0 or i == steps:
      jax.block_until_ready(params)
      elapsed = time.perf_counter() - since
      train_seconds += elapsed
      record = {
        "step": i,
        "train_seconds": round(train_seconds, 2),
        "train_loss": float(loss),
        f"{row.example}_per_second": examples / elapsed,
        **costs,
        **_evaluate(evaluate, params, rest, source.val_batches()),
      }
      records.append(record)
      print(json.dumps({"row": row.name, "method": method, **record}), flush=True)
      since, examples = time.perf_counter(), 0
  return {"records": records, "reconfigurations": reconfigurations}


def _time_to(records: list[dict[str, Any]], loss: float) -> float | None:
  """Training seconds at the first record whose validation loss is at most ``loss``."""
  return next((r["train_seconds"] for r in records if r["val_loss"] <= loss), None)


def summary(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """The comparison the page states: PruneTrain's end against dense's."""
  dense, pruned = runs["dense"]["records"], runs["prunetrain"]["records"]
  d, p = dense[-1], pruned[-1]
  reach = _time_to(pruned, d["val_loss"])
  return {
    "params_saved": 1.0 - p["params"] / d["params"],
    "flops_saved": 1.0 - p["flops"] / d["flops"],
    "val_loss_ratio": p["val_loss"] / d["val_loss"],
    "time_to_dense_loss_ratio": None if reach is None else reach / d["train_seconds"],
    "train_seconds_ratio": p["train_seconds"] / d["train_seconds"],
  }


def output_stem(folder: Path, args: argparse.Namespace) -> Path:
  """Where a run's files go: the page (``transformers``) at the default penalty ratio and the
  rows' own steps; a probe otherwise, under ``probes/`` and listed on the page:
  ``transformers_r<R>`` for another ratio, ``_s<N>`` for ``--steps N``."""
  parts = []
  if args.penalty_ratio != _parse([]).penalty_ratio:
    parts.append(f"r{args.penalty_ratio:g}")
  if args.steps is not None:
    parts.append(f"s{args.steps}")
  if not parts:
    return Path(folder) / "transformers"
  return pages.probes_dir(folder) / "_".join(["transformers", *parts])


def main(argv: Sequence[str] | None = None) -> None:
  args = _parse(argv)
  command = cli.command_line("prunetrain_transformers", argv)
  folder = pages.output_dir("prunetrain", args.publish, args.out)
  stem = output_stem(folder, args)
  saved_path = stem.parent / f"{stem.name}.json"
  saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
  if args.page_only:
    if not saved:
      raise SystemExit(f"--page-only: no saved runs at {saved_path}")
    write_page(stem, saved)
    print(f"wrote {stem.parent / stem.name}.md")
    return
  result = {"machine": machine_description(), "rows": saved.get("rows", {})}
  for name in args.rows:
    row = _ROWS[name]
    steps = args.steps or row.steps
    # One source per training, each in the same order from the seed; the data is read once.
    if name == "lm":
      text, val, described = stdlib_bytes(args.train_bytes)
      sources = {m: _LMData(text, val, args.val_windows, args.seed) for m in _METHODS}
    else:
      train = data.load("cifar10", root=args.root, split="train")
      train = train.balanced_subset(args.train_images, args.seed)
      test = data.load("cifar10", root=args.root, split="test")
      described = {}
      sources = {m: _ImageData(train, test, row.batch_size, args.seed) for m in _METHODS}
    described.update(sources["dense"].described)
    runs = {m: train_run(row, m, sources[m], args, steps) for m in _METHODS}
    result["rows"][name] = {
      "date": pages.utc_now(),
      "command": command,
      "settings": {
        **dataclasses.asdict(row),
        "steps": steps,
        "model": _VIT if name == "vit" else _LM,
        "interval": args.interval,
        "penalty_ratio": args.penalty_ratio,
        "threshold": args.threshold,
        "seed": args.seed,
        "data": described,
      },
      "runs": runs,
      "summary": summary(runs),
    }
    write_page(stem, result)
  print(f"wrote {stem.parent / stem.name}.md")

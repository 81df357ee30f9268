"""PruneTrain's reconfiguration on models the library did not build: what is supported, and exact.

For every hand-written architecture of :mod:`experiments.prunetrain.architectures` and two of
the zoo's models: trace the channel graph (:func:`jaxprune.prunetrain.channel_graph`), make half
the channels of every prunable group dead (every kernel entry over them zeroed, which is where
the group lasso drives them), reconfigure, and report

- supported / partly / refused, with the reason the graph gives for every blocked group;
- the largest |Δ output| of the reconfigured model against the zeroed model, in eval and in
  train mode (a batch of 8 random images, or token sequences for a language model);
- parameters and inference FLOPs per image (per sequence) before / after;
- the share of the parameters on no prunable axis: what no reconfiguration can remove, however
  many channels die (a transformer's residual stream, blocked by its norms, is most of it);
- the CPU time of one jitted SGD train step (batch 32) before / after, median of ``--steps``
  steps after a warm-up, both in this process.

    python -m experiments.run prunetrain_any_model            # a few minutes on 2 cores
    python -m experiments.run prunetrain_any_model --publish  # results/prunetrain/any_model.md

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from experiments.common import cli, masks, pages
from experiments.common.machine import machine_description
from experiments.prunetrain.architectures import ARCHITECTURES, example_input, input_spec
from jaxprune import models, train
from jaxprune import prunetrain as pt

_ZOO = {
  "zoo: prunetrain-resnet20": "prunetrain-resnet20",
  "zoo: prunetrain-vgg11": "prunetrain-vgg11",
}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="prunetrain_any_model", description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=10, help="timed train steps per model")
  parser.add_argument("--batch-size", type=int, default=32, help="batch of the timed steps")
  parser.add_argument("--dead", type=float, default=0.5, help="share of every group made dead")
  cli.add_output_arguments(parser, "prunetrain/")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.batch_size < 1 or not 0.0 < args.dead < 1.0:
    parser.error("--steps and --batch-size must be >= 1 and --dead in (0, 1)")
  return args


def _step_seconds(model: nnx.Module, inputs: jax.Array, labels: jax.Array, steps: int) -> float:
  """Median seconds of one jitted SGD step (cross-entropy over every output position) on
  ``model`` (a clone is trained)."""
  model = nnx.clone(model)
  optimizer = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, inputs, labels):
    def loss_fn(m):
      logits = m(inputs)
      return train.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  jax.block_until_ready(step(model, optimizer, inputs, labels))  # compile
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(step(model, optimizer, inputs, labels))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _max_delta(a: nnx.Module, b: nnx.Module, x: jax.Array) -> dict[str, float]:
  """max |a(x) − b(x)| in eval and train mode (clones: train mode updates statistics), and each
  relative to max |a(x)| (``eval_rel``, ``train_rel``)."""
  out = {}
  for mode in ("eval", "train"):
    ca, cb = nnx.clone(a), nnx.clone(b)
    getattr(ca, mode)()
    getattr(cb, mode)()
    ya, yb = np.asarray(ca(x)), np.asarray(cb(x))
    out[mode] = float(np.max(np.abs(ya - yb)))
    out[f"{mode}_rel"] = out[mode] / max(float(np.max(np.abs(ya))), np.finfo(np.float32).tiny)
  return out


def _unremovable_share(model: nnx.Module, graph: pt.ChannelGraph) -> float:
  """The share of ``model``'s parameters in variables with no prunable axis."""
  prunable = {u.path for g in graph.prunable for u in g.uses}
  sizes = {
    tuple(path): int(np.size(v)) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }
  return sum(n for path, n in sizes.items() if path not in prunable) / sum(sizes.values())


def measure(name: str, model: nnx.Module, args: argparse.Namespace) -> dict[str, Any]:
  """One row of the page."""
  shape, dtype, _ = input_spec(name)
  graph = pt.channel_graph(model, shape, input_dtype=dtype)
  row: dict[str, Any] = {
    "name": name,
    "prunable": [f"{g.name} ({g.width})" for g in graph.prunable],
    "blocked": {f"{g.name} ({g.width})": list(g.blocked) for g in graph.blocked},
  }
  if not graph.prunable:
    row["status"] = "refused"
    return row
  row["status"] = "partly" if graph.unfollowed() else "supported"
  row["unremovable"] = _unremovable_share(model, graph)
  masks.kill_channels(model, 1.0 - args.dead, input_shape=shape, input_dtype=dtype)
  new, _, report = pt.reconfigure(model, None, input_shape=shape, input_dtype=dtype)
  x, _ = example_input(name, jax.random.key(1), 8)
  inputs, labels = example_input(name, jax.random.key(0), args.batch_size)
  row.update(
    delta=_max_delta(model, new, x),
    params=[report.params_before, report.params_after],
    flops=[report.flops_before, report.flops_after],
    step_s=[_step_seconds(m, inputs, labels, args.steps) for m in (model, new)],
  )
  return row


def _delta(delta: dict[str, float], mode: str) -> str:
  """``absolute (relative)``; a row saved before the relative figure was recorded shows the
  absolute one alone."""
  rel = delta.get(f"{mode}_rel")
  return f"{delta[mode]:.1e}" + (f" ({rel:.1e})" if rel is not None else "")


def _page(rows: list[dict[str, Any]], command: str) -> str:
  lines = [
    "# PruneTrain on any Flax NNX model: channel-graph coverage",
    "",
    f"`{command}` — {pages.utc_now()}, {machine_description()}.",
    "",
    "Each model is traced, half the channels of every prunable group are made dead (their",
    "kernel entries zeroed, as the group lasso drives them), and the model is reconfigured.",
    "|Δ| is the largest output difference of the reconfigured model against the zeroed one, in",
    "brackets relative to the zeroed model's largest output (8 random images; 8 random token",
    "sequences of 32 for the language model, whose FLOPs are per sequence). Step time: one",
    "jitted SGD train step at batch 32, median, CPU. *Unremovable*: the share of the parameters",
    "in variables with no prunable axis, which no reconfiguration removes however many channels",
    "die.",
    "",
    "| model | status | prunable / blocked groups | max \\|Δ\\| eval | max \\|Δ\\| train "
    "| params before → after | unremovable | FLOPs/image before → after | step ms before → after |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for row in rows:
    counts = f"{len(row['prunable'])} / {len(row['blocked'])}"
    if row["status"] == "refused":
      lines.append(f"| {row['name']} | refused | {counts} | – | – | – | – | – | – |")
      continue
    (p0, p1), (f0, f1), (s0, s1) = row["params"], row["flops"], row["step_s"]
    lines.append(
      f"| {row['name']} | {row['status']} | {counts} | {_delta(row['delta'], 'eval')} "
      f"| {_delta(row['delta'], 'train')} | {p0:,} → {p1:,} | {row['unremovable']:.0%} "
      f"| {f0 / 1e6:.2f}M → {f1 / 1e6:.2f}M "
      f"| {s0 * 1e3:.1f} → {s1 * 1e3:.1f} ({s1 / s0:.2f}×) |"
    )
  lines += ["", "## Why groups are blocked", ""]
  lines += [
    "A blocked group keeps all its channels. *fixed*: the model's input or output; "
    "*normalized*: a statistic is taken over the channels (LayerNorm: removing a channel "
    "changes the others' normalisation, so the function would change); *unfollowed*: an "
    "operation the graph cannot follow (named; `PruneTrainCallback(strict=True)` refuses such a "
    "model before training, `strict=False` prunes the other groups).",
    "",
    "A transformer's residual stream is *normalized* (every LayerNorm / RMSNorm takes its "
    "statistic over it), so it keeps its width: each projection keeps its stream side and "
    "shrinks only with the heads and MLP units it serves, and the embeddings, norms and output "
    "layer never shrink (the *unremovable* column is that floor). An attention whose heads all "
    "die, or an MLP whose units all die, goes with its norm where the module declares it a "
    "removable branch (the two residual branches of `jaxprune.models.transformer.Block`); a "
    "block that loses both passes its input on, and the stream stays.",
    "",
  ]
  for row in rows:
    reasons = sorted({r for rs in row["blocked"].values() for r in rs if not r.startswith("fixed")})
    lines.append(
      f"- **{row['name']}**: "
      + ("; ".join(reasons) if reasons else "only the input and output are fixed")
    )
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """Measures every model and writes ``any_model.{md,json}``."""
  args = _parse(argv)
  builders = {name: lambda b=build: b(nnx.Rngs(0)) for name, build in ARCHITECTURES.items()}
  builders.update(
    {
      name: lambda z=zoo: models.create(z, num_classes=10, rngs=nnx.Rngs(0))
      for name, zoo in _ZOO.items()
    }
  )
  rows = []
  for name, build in builders.items():
    rows.append(measure(name, build(), args))
    print(
      rows[-1]["name"],
      rows[-1]["status"],
      rows[-1].get("delta"),
      rows[-1].get("step_s"),
      flush=True,
    )
  folder = pages.output_dir("prunetrain", args.publish, args.out)
  command = cli.command_line("prunetrain_any_model", argv)
  pages.write_result(folder / "any_model", {"command": command, "rows": rows}, _page(rows, command))
  print(f"wrote {folder / 'any_model.md'}")
  return rows


if __name__ == "__main__":
  main()

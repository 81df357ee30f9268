"""Every method's training step against dense, on the device at hand.

One command, so that a short window on a GPU produces the whole table. For each model below
and each compute dtype (``--dtypes``, fp32 and bf16 by default; parameters, BatchNorm
statistics, loss and optimizer state stay float32), the trainer's own jitted train step
(forward, backward, optimizer; donated buffers) is timed on one fixed batch for dense training
and for each registered method in its steady state:

* **ClickTrain** (``clicktrain-resnet32`` and ``clicktrain-vgg11``, CIFAR, at the paper's
  per-layer ratios): the real transform run through its stages on a one-step-per-epoch schedule
  until the hard prune, then timed in the pruned stage with the pruned convs left dense and
  masked, all switched to the fine-grained pattern-sparse layers (``threshold=0``), switched
  where each measured faster (the default dispatch,
  :func:`jaxprune.clicktrain.execution.conversion.to_sparse_layers`), and in the aligned mode
  (``filter_groups=G``, every pruned conv an aligned layer; for ``G > 1`` also with the columns
  made once for every group, ``columns="shared"``);
* **SDGP** (``sdgp-resnet9``, CIFAR): each N:M method, 2:4, with each backend (the Pallas
  kernel only where it compiles: on CPU it would run interpreted);
* **PruneTrain** (``prunetrain-resnet32``, CIFAR): the group-lasso optimizer at full width, and
  the model a reconfiguration leaves when a fraction of every channel tensor is dead
  (:func:`jaxprune.prunetrain.reconfigure`), with its training-FLOP ratio;
* an **ImageNet ResNet** (``imagenet-resnet18``, 224x224): dense, SDGP, ClickTrain's aligned
  mode and a PruneTrain reconfiguration.

Each time is the median of ``--repeats`` steps after two warm-up steps (``block_until_ready``
after each); compile time is the step's ``lower(...).compile()``; every ratio divides by the
dense step of the same model and dtype measured in the same run (an aligned row and its
"SGD + masks" pair, whose ratio is the transform's cost after the prune, are timed again in
alternating rounds, :func:`time_pair`). Rows are printed and saved
as they are measured (``step_time_<platform>[_small].json`` and ``.md``), so a run cut short
keeps a table; ``--max-seconds`` stops measuring (listing what was left) before a device
window closes::

    python -m experiments.run step_bench --publish            # CIFAR batch 128, ImageNet 64
    python -m experiments.run step_bench --small --publish    # quarter width, minutes on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pallas_kernels
from experiments.common import cli, pages
from experiments.common.machine import machine_description
from experiments.common.masks import clicktrain_to_hard_prune, kill_channels, step_until_pruned
from jaxprune import flops, masking, methods, models, train
from jaxprune import prunetrain as pt
from jaxprune.clicktrain import masks as clicktrain_masks
from jaxprune.clicktrain import specialize_pruned
from jaxprune.clicktrain.execution import to_sparse_layers
from jaxprune.clicktrain.execution.aligned_conv import COLUMNS
from jaxprune.clicktrain.execution.options import default_backend
from jaxprune.sdgp import auto_backend
from jaxprune.timing import median_call_ms
from jaxprune.train import TrainState, split_model, step_functions, step_settings

_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
_SUITES = ("clicktrain", "clicktrain-vgg11", "sdgp", "prunetrain", "imagenet")
_SDGP_METHODS = ("magnitude", "rescaled_magnitude", "mvue", "random")


@dataclasses.dataclass(frozen=True)
class _Model:
  """One model of the table: its registry name and the batch it is timed at."""

  name: str
  batch: int
  image: int
  num_classes: int


# ---------------------------------------------------------------------------- the timed step


class _Stepper:
  """The trainer's train step (:func:`jaxprune.train.step_functions`, donated buffers)
  for one model and optimizer on one fixed batch."""

  def __init__(self, model: nnx.Module, tx, batch: tuple[jax.Array, jax.Array], opt_state=None):
    self.graphdef, _, params, rest = split_model(model)
    # The step donates its inputs: copies, so the arrays ``model`` shares with the clones of
    # the other rows stay alive.
    params, rest = jax.tree.map(jnp.copy, (params, rest))
    self.tx = tx
    self.fns = step_functions(step_settings(model, tx))
    opt_state = tx.init(params) if opt_state is None else opt_state
    self.state = TrainState.start(params, rest, opt_state)
    self.batch = batch
    self.executable: Callable[..., Any] = self.fns.train

  def compile(self) -> float:
    """Seconds to lower and compile the step (then used for every call). JAX's caches are
    cleared first: a variant whose step equals one compiled before (the masked dense model
    after the pruning run that made it) would otherwise read as free."""
    jax.clear_caches()
    start = time.perf_counter()
    self.executable = self.fns.train.lower(self.state, *self.batch).compile()
    return time.perf_counter() - start

  def step(self) -> Any:
    self.state = self.executable(self.state, *self.batch)
    return self.state.params

  def snapshot(self) -> tuple[nnx.Module, Any]:
    """A fresh model with the current parameters and a copy of the optimizer state (the step
    donates its buffers, so a variant timed later needs its own)."""
    params, rest, opt_state, _ = jax.tree.map(jnp.copy, self.state)
    return nnx.merge(self.graphdef, params, rest), opt_state


def time_steps(stepper: _Stepper, repeats: int) -> dict[str, float]:
  """``ms`` (median of ``repeats`` steps after two warm-up steps) and ``compile_s``."""
  compile_s = stepper.compile()
  return {"ms": median_call_ms(stepper.step, repeats=repeats, warmup=2), "compile_s": compile_s}


def time_pair(first: _Stepper, second: _Stepper, repeats: int) -> tuple[float, float]:
  """Both steppers' ms (each compiled already), timed in ``repeats`` alternating rounds of three
  steps: the median of each one's round medians. For two rows whose ratio is the measurement
  (a transform against the same layers under SGD + its masks): the machine's drift reaches both."""
  times: tuple[list[float], list[float]] = ([], [])
  for _ in range(repeats):
    for stepper, out in zip((first, second), times):
      out.append(median_call_ms(stepper.step, repeats=3, warmup=0))
  return statistics.median(times[0]), statistics.median(times[1])


# ------------------------------------------------------------------------------ the methods


def _inner():
  return train.sgd(0.01, momentum=0.9, weight_decay=5e-4)


def _create(spec: _Model, dtype: str, width: float) -> nnx.Module:
  return models.create(
    spec.name,
    num_classes=spec.num_classes,
    rngs=nnx.Rngs(0),
    width_multiplier=width,
    dtype=_DTYPES[dtype],
  )


def _pruned_clicktrain(model: nnx.Module, model_name: str, batch, filter_groups: int | None):
  """ClickTrain's transform run (paper mode, one step per epoch) until its hard prune, at the
  kernel-prune ratios of ``model_name``'s Table 1 row (ResNets: 55/65/75% by stage).

  Returns the stepper in the pruned stage, the weight masks and the pruned layers'
  compression (their weights / kept weights)."""
  method, run = clicktrain_to_hard_prune(model_name, filter_groups=filter_groups)
  stepper = _Stepper(model, method.make_tx(_inner(), run), batch)

  def step():
    stepper.step()
    return stepper.state[2]

  step_until_pruned(step, run)
  masks = clicktrain_masks(stepper.state[2], stepper.state[0])
  kept = [np.asarray(m) for m in jax.tree.leaves(masks)]
  return stepper, masks, sum(m.size for m in kept) / sum(float(m.sum()) for m in kept)


def clicktrain_variants(
  model: nnx.Module,
  batch,
  groups: Sequence[int],
  *,
  model_name: str = "clicktrain-resnet32",
  dispatch: bool = True,
) -> Iterator[tuple[str, _Stepper, dict[str, Any]]]:
  """ClickTrain after the hard prune at ``model_name``'s ratios: each dispatch choice
  (``dispatch``), then the aligned mode at each of ``groups`` (``G > 1`` with per-group and
  shared columns)."""
  if dispatch:
    pruned, masks, compression = _pruned_clicktrain(nnx.clone(model), model_name, batch, None)
    input_shape = tuple(batch[0].shape)
    fine = f"fine-grained ({default_backend()})"
    for label, threshold in (("masked dense", None), (fine, 0.0), ("measured dispatch", None)):
      fresh, opt_state = pruned.snapshot()
      row: dict[str, Any] = {"compression": compression}
      if label != "masked dense":
        start = time.perf_counter()
        fresh, choices = to_sparse_layers(
          fresh, masks, threshold=threshold, input_shape=input_shape
        )
        row["convert_s"] = time.perf_counter() - start
        row["sparse_layers"] = f"{sum(c.backend != 'dense' for c in choices)}/{len(choices)}"
      yield label, _Stepper(fresh, pruned.tx, batch, specialize_pruned(opt_state)), row
    del pruned
  for g in groups:
    aligned, masks, compression = _pruned_clicktrain(nnx.clone(model), model_name, batch, g)
    for columns in COLUMNS if g > 1 else COLUMNS[:1]:
      fresh, opt_state = aligned.snapshot()
      fresh, choices = to_sparse_layers(
        fresh, masks, threshold=0.0, filter_groups=g, columns=columns
      )
      row = {"compression": compression, "sparse_layers": f"{len(choices)}/{len(choices)}"}
      label = f"aligned G={g}" + (" shared" if columns == "shared" else "")
      paired = columns == COLUMNS[0]
      # ``timed_with_next``: the next row is its pair, so the main loop keeps this stepper.
      facts = {**row, "timed_with_next": True} if paired else row
      yield label, _Stepper(fresh, aligned.tx, batch, specialize_pruned(opt_state)), facts
      if paired:
        # The same layers under the inner optimizer and the final masks alone: what ClickTrain's
        # transform in its pruned stage (specialised, as the trainer runs it) should match.
        plain = optax.chain(_inner(), masking.mask(masks))
        yield f"{label}, SGD + masks", _Stepper(fresh, plain, batch), {**row, "versus": label}


def sdgp_variants(
  model: nnx.Module, batch, sdgp_methods: Sequence[str]
) -> Iterator[tuple[str, _Stepper, dict[str, Any]]]:
  """SDGP 2:4 with each method and each backend that compiles here: the Pallas kernel only on
  a GPU whose JAX has the Pallas Triton backend (on CPU it would run interpreted, which times
  the interpreter). The row of the backend ``backend="auto"`` picks here is marked."""
  platform = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
  backends = ["reference"]
  if jax.default_backend() == "gpu" and pallas_kernels.triton_available():
    backends.append("pallas")
  run = methods.Run(steps_per_epoch=1, epochs=1)
  for method in sdgp_methods:
    for backend in backends:
      sdgp = methods.get("sdgp", n=2, m=4, method=method, backend=backend)
      converted = sdgp.convert(nnx.clone(model))
      facts = {"auto": backend == auto_backend(platform)}
      yield (
        f"sdgp 2:4 {method} ({backend})",
        _Stepper(converted, sdgp.make_tx(_inner(), run), batch),
        facts,
      )


def prunetrain_variants(
  model: nnx.Module, batch, keep: Sequence[float], *, full_width: bool = True
) -> Iterator[tuple[str, _Stepper, dict[str, Any]]]:
  """PruneTrain's group-lasso step at full width (``full_width``) and on the model a
  reconfiguration leaves when ``1 - keep`` of every channel tensor is dead, with the ratio of
  its training FLOPs to the dense model's."""
  method = methods.get("prunetrain")
  run = methods.Run(steps_per_epoch=1, epochs=1)
  input_shape = tuple(batch[0].shape)
  dense_flops = flops.training_flops_per_step(model, input_shape)
  if full_width:
    tx = method.make_tx(_inner(), run)
    yield "group lasso, full width", _Stepper(nnx.clone(model), tx, batch), {"flops": 1.0}
  for fraction in keep:
    killed = nnx.clone(model)
    kill_channels(killed, fraction)
    smaller, _, _ = pt.reconfigure(killed, None, input_shape=(1, *input_shape[1:]))
    ratio = flops.training_flops_per_step(smaller, input_shape) / dense_flops
    tx = method.make_tx(_inner(), run)
    label = f"group lasso, reconfigured to {fraction:.0%} channels"
    yield label, _Stepper(smaller, tx, batch), {"flops": ratio}


def _variants(
  suite: str, spec: _Model, model: nnx.Module, batch, args
) -> Iterator[tuple[str, _Stepper, dict]]:
  if suite.startswith("clicktrain"):
    return clicktrain_variants(model, batch, args.groups, model_name=spec.name)
  if suite == "sdgp":
    return sdgp_variants(model, batch, args.sdgp_methods)
  if suite == "prunetrain":
    return prunetrain_variants(model, batch, args.keep)
  # ImageNet: one steady state per paper.
  return itertools.chain(
    sdgp_variants(model, batch, args.sdgp_methods[:1]),
    clicktrain_variants(model, batch, args.groups[:1], dispatch=False),
    prunetrain_variants(model, batch, args.keep[-1:], full_width=False),
  )


# ------------------------------------------------------------------------------- the table


def _models(args) -> dict[str, _Model]:
  cifar, imagenet = (16, 4) if args.small else (128, 64)
  return {
    "clicktrain": _Model("clicktrain-resnet32", args.batch or cifar, 32, 10),
    "clicktrain-vgg11": _Model("clicktrain-vgg11", args.batch or cifar, 32, 10),
    "sdgp": _Model("sdgp-resnet9", args.batch or cifar, 32, 10),
    "prunetrain": _Model("prunetrain-resnet32", args.batch or cifar, 32, 10),
    "imagenet": _Model(
      "imagenet-resnet18", args.imagenet_batch or imagenet, args.imagenet_size, 1000
    ),
  }


def _batch(spec: _Model, seed: int) -> tuple[jax.Array, jax.Array]:
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(spec.batch, spec.image, spec.image, 3)).astype(np.float32)
  y = rng.integers(0, spec.num_classes, spec.batch).astype(np.int32)
  return jnp.asarray(x), jnp.asarray(y)


def _notes(row: dict[str, Any]) -> str:
  notes = []
  if "compression" in row:
    notes.append(f"pruned layers {row['compression']:.1f}× compressed")
  if "sparse_layers" in row:
    notes.append(f"{row['sparse_layers']} layers sparse")
  if row.get("interleaved"):
    notes.append("timed in alternating rounds with its pair")
  if "convert_s" in row:
    notes.append(f"conversion {row['convert_s']:.1f} s")
  if row.get("auto"):
    notes.append('what `backend="auto"` runs here')
  if "flops" in row:
    notes.append(f"training FLOPs {row['flops']:.2f}× dense")
  if "error" in row:
    notes.append(f"failed: {row['error']}")
  return "; ".join(notes)


def to_markdown(result: dict[str, Any]) -> str:
  lines = [
    "# Train step of every method against dense",
    "",
    f"Command: `{result['command']}`  ",
    f"Date: {result['date']}  ",
    f"Machine: {result['machine']}  ",
    f"Device: {result['device']}, JAX {result['jax']}  ",
    (
      f"Median of {result['repeats']} jitted train steps (forward, backward, optimizer; donated "
      "buffers) after two warm-up steps; compile = `lower().compile()` of the step; ratio = time "
      "/ the dense step of the same model and dtype in this run (below 1: faster than dense)."
    ),
    "",
  ]
  for suite in dict.fromkeys(r["suite"] for r in result["rows"]):
    rows = [r for r in result["rows"] if r["suite"] == suite]
    first = rows[0]
    lines += [
      (
        f"## {suite}: `{first['model']}`, batch {first['batch']}, "
        f"{first['image']}×{first['image']}, width ×{first['width']}"
      ),
      "",
      "| dtype | variant | ms / step | vs dense | compile s | notes |",
      "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
      if "ms" not in r:
        lines.append(f"| {r['dtype']} | {r['variant']} | – | – | – | {_notes(r)} |")
        continue
      lines.append(
        f"| {r['dtype']} | {r['variant']} | {r['ms']:.2f} | {r['ratio']:.2f}× | "
        f"{r['compile_s']:.1f} | {_notes(r)} |"
      )
    lines.append("")
  if result["not_measured"]:
    lines += ["## Not measured (time budget `--max-seconds` spent)", ""]
    lines += [f"- {item}" for item in result["not_measured"]] + [""]
  return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="step_bench", description=__doc__.split("\n")[0])
  parser.add_argument("--suites", nargs="+", default=list(_SUITES), choices=_SUITES)
  parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(_DTYPES))
  parser.add_argument("--groups", type=int, nargs="+", default=None, help="aligned-mode G")
  parser.add_argument("--sdgp-methods", nargs="+", default=None, choices=_SDGP_METHODS)
  parser.add_argument(
    "--keep", type=float, nargs="+", default=[0.75, 0.5], help="PruneTrain live channel fractions"
  )
  parser.add_argument("--width", type=float, default=None, help="width multiplier (default 1)")
  parser.add_argument("--batch", type=int, default=None, help="CIFAR batch (default 128)")
  parser.add_argument("--imagenet-batch", type=int, default=None, help="default 64")
  parser.add_argument("--imagenet-size", type=int, default=None, help="default 224")
  parser.add_argument("--repeats", type=int, default=None, help="timed steps (default 20)")
  parser.add_argument(
    "--max-seconds",
    type=float,
    default=None,
    help="stop starting new rows after this long (default 270 on an accelerator: a 5-minute "
    "window; 840 on CPU)",
  )
  parser.add_argument(
    "--small",
    action="store_true",
    help="quarter width, CIFAR batch 16, ImageNet 64×64 batch 4, 10 repeats, G=1, two SDGP "
    "methods: minutes on a 2-core CPU",
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--name", default=None, help="file stem of the table (default step_time_<platform>[_small])"
  )
  cli.add_output_arguments(parser, "benchmarks/")
  args = parser.parse_args(argv)
  small = args.small
  defaults = {
    "width": 0.25 if small else 1.0,
    "imagenet_size": 64 if small else 224,
    "repeats": 10 if small else 20,
    "groups": [1] if small else [1, 2],
    "sdgp_methods": ["magnitude", "mvue"] if small else list(_SDGP_METHODS),
    "max_seconds": 840.0 if jax.default_backend() == "cpu" else 270.0,
  }
  cli.fill_defaults(args, defaults)
  if min(args.groups) < 1:
    parser.error("--groups must be >= 1")
  if any(not 0 < k < 1 for k in args.keep):
    parser.error("--keep fractions must be in (0, 1)")
  if args.repeats < 1 or args.width <= 0:
    parser.error("--repeats must be >= 1 and --width > 0")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  out = pages.output_dir("benchmarks", args.publish, args.out)
  device = jax.devices()[0]
  result: dict[str, Any] = {
    "command": cli.command_line("step_bench", argv),
    "date": datetime.date.today().isoformat(),
    "machine": machine_description(),
    "device": f"{device.platform} ({device.device_kind})",
    "jax": jax.__version__,
    "repeats": args.repeats,
    "rows": [],
    "not_measured": [],
  }
  stem = args.name or f"step_time_{jax.default_backend()}" + ("_small" if args.small else "")

  def save():
    pages.write_result(out / stem, result, to_markdown(result))

  deadline = time.perf_counter() + args.max_seconds
  specs = _models(args)
  for suite in args.suites:
    spec = specs[suite]
    for dtype in args.dtypes:
      if time.perf_counter() > deadline:
        result["not_measured"].append(f"{suite} {dtype}: every variant")
        continue
      base = {
        "suite": suite,
        "model": spec.name,
        "batch": spec.batch,
        "image": spec.image,
        "width": args.width,
        "dtype": dtype,
      }
      model = _create(spec, dtype, args.width)
      batch = _batch(spec, args.seed)
      dense = time_steps(_Stepper(nnx.clone(model), _inner(), batch), args.repeats)
      rows = [{**base, "variant": "dense", **dense, "ratio": 1.0}]
      _record(result, rows[-1], save)
      variants = _variants(suite, spec, model, batch, args)
      last: tuple[dict[str, Any], _Stepper] | None = None
      while True:
        if time.perf_counter() > deadline:
          result["not_measured"].append(f"{suite} {dtype}: the variants after the last row")
          break
        try:
          label, stepper, facts = next(variants)
          timed = time_steps(stepper, args.repeats)
        except StopIteration:
          break
        except Exception as error:  # noqa: BLE001 (one failing method must not lose the table)
          _record(
            result, {**base, "variant": "?", "error": f"{type(error).__name__}: {error}"}, save
          )
          break
        keep = facts.pop("timed_with_next", False)
        if last is not None and facts.get("versus") == last[0]["variant"]:
          # A pair whose ratio is the point: timed again in alternating rounds, both rows.
          ms = time_pair(last[1], stepper, args.repeats)
          last[0].update(ms=ms[0], ratio=ms[0] / dense["ms"], interleaved=True)
          timed = {**timed, "ms": ms[1]}
          facts = {**facts, "interleaved": True}
        row = {**base, "variant": label, **facts, **timed, "ratio": timed["ms"] / dense["ms"]}
        _record(result, row, save)
        # Only the first of a pair stays alive past its row (a stepper holds a model's state).
        last = (row, stepper) if keep else None
        del stepper
  save()
  print(to_markdown(result))
  return result


def _record(result: dict[str, Any], row: dict[str, Any], save: Callable[[], None]) -> None:
  result["rows"].append(row)
  save()
  if "ms" in row:
    print(
      f"{row['suite']} {row['dtype']} {row['variant']}: {row['ms']:.2f} ms "
      f"({row['ratio']:.2f}x dense), compile {row['compile_s']:.1f} s",
      flush=True,
    )
  else:
    print(f"{row['suite']} {row['dtype']} {row['variant']}: {row.get('error')}", flush=True)

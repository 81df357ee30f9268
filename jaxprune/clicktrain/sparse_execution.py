"""Per-layer sparse execution of a pattern-pruned model (ClickTrain §5.2, §5.4).

After the hard prune ClickTrain's masks never change, so the execution of each pruned conv is
decided **once**: it becomes a :class:`~jaxprune.clicktrain.sparse_layers.PatternConv` (the
paper's fine-grained layout, §5.1) or, for masks of the aligned mode, an
:class:`~jaxprune.clicktrain.sparse_layers.AlignedConv`, or stays an ordinary conv whose
pruned weights ClickTrain's masks keep at zero. There is no per-step branching: the choice is
part of the model's structure, compiled once.

**By default each layer is timed both ways** (forward and both gradients, at its real input
shape, once per conversion) and keeps the faster: on an H100 the fine-grained kernels are
5-9x slower than cuDNN per layer and a whole step with every pruned conv sparse 6.6x
(VGG-11) and 12.5x (ResNet-32) slower than the dense masked step; on the 2-core CPU the
reference SpMM also loses at ClickTrain's sparsities; the aligned layout wins on some layers
and loses on others on both (``docs/design.md``, ``experiments/results/benchmarks/``). Layers
timed in isolation do not add up to a step (on the H100 the per-layer choice made VGG-11's
step 1.20x dense, slower than all-dense or all-aligned), so the dispatch then times **the whole
model's training pass** all dense, as the layers chose and all sparse, and keeps the fastest
(:class:`ConversionReport`). A fixed threshold (the paper's 65% on its GPU, §5.2) stays.

The layout is a static attribute of the layer, not part of its state: a checkpoint holds the
same arrays before and after the switch, and a resumed run rebuilds the layouts from the masks
in the optimizer state (:class:`SparseExecution` does this when a fit starts).

Example::

  weight_masks = clicktrain.masks(opt_state, nnx.state(model, nnx.Param))
  model, report = convert_model(model, weight_masks, input_shape=(128, 32, 32, 3))
  print(format_report(report))

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxprune import flops
from jaxprune.clicktrain._dispatch import (
  DEFAULT_THRESHOLDS,
  check_dispatch_options,
  default_backend,
  default_threshold,
  fixed_threshold,
)
from jaxprune.clicktrain.aligned_conv import COLUMNS, aligned_conv, shared_columns
from jaxprune.clicktrain.aligned_layout import build_aligned_layout
from jaxprune.clicktrain.layer_timing import time_layer, time_model_pass, time_train_pass
from jaxprune.clicktrain.layout import build_layout
from jaxprune.clicktrain.pattern_conv import pattern_conv
from jaxprune.clicktrain.readouts import filter_partition, masks, stage_name
from jaxprune.clicktrain.sparse_layers import AlignedConv, PatternConv, check_convertible
from jaxprune.masking import count_refilled
from jaxprune.models import replace_submodule, submodule
from jaxprune.paths import flatten_with_paths
from jaxprune.timing import median_call_ms
from jaxprune.train import Callback

__all__ = [
  "DEFAULT_THRESHOLDS",
  "AlignedConv",
  "ConversionReport",
  "LayerChoice",
  "PatternConv",
  "SparseExecution",
  "convert_model",
  "default_backend",
  "default_threshold",
  "fixed_threshold",
  "format_report",
  "median_call_ms",
  "pattern_convs",
  "time_layer",
  "time_model_pass",
  "time_train_pass",
]

_NHWC = ("NHWC", "HWIO", "NHWC")


class ConversionReport(list):
  """:func:`convert_model`'s per-layer :class:`LayerChoice` list, with the whole-model check.

  Attributes:
    model_ms: the measured training pass of the whole model (:func:`time_model_pass`) per
      candidate: ``"dense"`` (no layer switched), ``"per-layer"`` (each layer on its own
      faster path) and ``"all sparse"`` (every pruned conv switched), those that differ; empty
      when the check did not run (a fixed threshold, no layer faster sparse, or turned off).
    kept: the candidate kept (the fastest), or ``None`` when the check did not run.
  """

  def __init__(self, choices=(), model_ms: Mapping[str, float] | None = None, kept=None):
    super().__init__(choices)
    self.model_ms = dict(model_ms or {})
    self.kept = kept


@dataclasses.dataclass(frozen=True)
class LayerChoice:
  """What :func:`convert_model` decided for one pruned conv.

  Attributes:
    path: the conv's path in the model (``"/"``-joined).
    kernel_shape: its HWIO kernel shape.
    sparsity: fraction of zero weights under its mask.
    balanced: every filter keeps the same number of weights.
    backend: ``"dense"`` (left as it was), ``"aligned"`` (columns per filter group),
      ``"aligned (shared columns)"`` (one set of columns for every group, measured faster),
      or the fine-grained backend it runs.
    dense_ms, sparse_ms: measured forward + backward times (when measured; ``sparse_ms`` of
      the fastest sparse way).
    layer_backend: what the layer's own timing chose, where the whole-model check overruled
      it (``None`` elsewhere).
  """

  path: str
  kernel_shape: tuple[int, ...]
  sparsity: float
  balanced: bool
  backend: str
  dense_ms: float | None = None
  sparse_ms: float | None = None
  layer_backend: str | None = None


def _sparse_layer(mask: np.ndarray, name: str, filter_groups, nnz_per_kernel, backend, columns):
  """``(sparsity, balanced, variants, timing_key)`` of one mask. ``variants``: each way a
  sparse layer can run it, by its label in the report (the default first), as ``(build(conv)
  -> layer, conv_fn(strides, pad) -> f(x, w))``; ``timing_key``: what besides the geometry and
  weight count sets its times (masks that agree on it are timed once)."""
  try:
    if filter_groups is not None:
      layout = build_aligned_layout(mask, filter_groups)
      balanced = len({g.contraction for g in layout.groups}) == 1
      # Several groups: their columns per group or shared (aligned_conv), whichever is faster.
      modes = (columns,) if columns else COLUMNS if len(layout.groups) > 1 else COLUMNS[:1]
      variants = {
        ("aligned" if c == "per_group" else f"aligned ({c} columns)"): (
          lambda conv, c=c: AlignedConv.from_conv(conv, layout, name=name, columns=c),
          lambda strides, pad, c=c: (
            lambda x, w: aligned_conv(x, w, layout, strides=strides, padding=pad, columns=c)
          ),
        )
        for c in modes
      }
      groups = tuple(sorted(g.contraction for g in layout.groups))
      # The shared form's cost follows the union's size (only timed with several groups).
      union = shared_columns(layout)[0].contraction if len(modes) > 1 else None
      return layout.sparsity, balanced, variants, (groups, union)
    kernel_size = mask.shape[0] * mask.shape[1]
    per_kernel = None if nnz_per_kernel is None else min(nnz_per_kernel, kernel_size)
    layout = build_layout(mask, nnz_per_kernel=per_kernel)
  except ValueError as err:
    raise ValueError(f"weight_masks: {name}: {err}") from None
  variants = {
    backend: (
      lambda conv: PatternConv.from_conv(conv, layout, backend=backend, name=name),
      lambda strides, pad: (
        lambda x, w: pattern_conv(x, w, layout, strides=strides, padding=pad, backend=backend)
      ),
    )
  }
  return layout.sparsity, layout.balanced, variants, None


def convert_model(
  model: nnx.Module,
  weight_masks: Any,
  *,
  threshold: float | str | None = None,
  backend: str | None = None,
  nnz_per_kernel: int | None = 4,
  input_shape: Sequence[int] | None = None,
  repeats: int = 3,
  filter_groups: Any = None,
  check_model: bool | None = None,
  columns: str | None = None,
) -> tuple[nnx.Module, ConversionReport]:
  """Switches the pruned convs of ``model`` to a sparse layer where it pays, in place.

  Args:
    model: an NNX model (mutated in place and returned).
    weight_masks: a pytree like ``nnx.state(model, nnx.Param)`` with a 0/1 mask for every
      pruned conv kernel and ``None`` elsewhere (``jaxprune.clicktrain.masks(opt_state,
      params)``).
    threshold: ``"measure"`` (the default, :func:`default_threshold`): time each layer both
      ways at its real input shape, in its compute dtype (forward + both gradients,
      :func:`time_train_pass`; layers of one geometry and sparsity are timed once) and keep
      the faster. A number in [0, 1]:
      the sparsity above which a layer goes sparse; ``"fixed"``: :func:`fixed_threshold` of the
      platform.
    backend: the fine-grained sparse backend; default :func:`default_backend`.
    nnz_per_kernel: weights per kept kernel the fine-grained layouts enforce (4 for
      ClickTrain's patterns; a 1x1 kernel keeps its single weight); ``None`` accepts any.
    input_shape: the model's input batch shape, needed to measure.
    repeats: timed calls per measurement (median).
    filter_groups: masks of ClickTrain's aligned mode: the groups (as
      :func:`~jaxprune.clicktrain.aligned_layout.group_filters`, or ``"auto"``) the sparse
      layers are :class:`AlignedConv` on, the same for every layer; or a mapping from each
      masked kernel's path (``jaxprune.paths.path_string``, e.g. ``"stages/0/0/conv1/conv/
      kernel"``) to its groups: :func:`~jaxprune.clicktrain.filter_partition` of the optimizer
      state, which holds the clustered partitions of ``filter_grouping="clustered"`` (the
      layer's outputs come back in the conv's filter order). ``None``: the fine-grained
      :class:`PatternConv`.
    check_model: with ``threshold="measure"`` (default there: on), when some layer measures
      faster sparse, also time the whole model's training pass all dense, as the layers chose
      and with every pruned conv sparse (:func:`time_model_pass`, at ``input_shape``), and keep
      the fastest: switching between the dense convolutions and the sparse layers costs what
      no single layer's timing sees.
    columns: how an aligned layer of several filter groups makes its columns
      (:func:`~jaxprune.clicktrain.aligned_conv.aligned_conv`): ``"per_group"`` or
      ``"shared"``; ``None`` (default): measured, both timed and the faster kept (under a
      fixed threshold: per group).

  Returns:
    ``(model, choices)``: a :class:`ConversionReport`, one :class:`LayerChoice` per masked
    conv in model order, with the whole-model times.

  Raises:
    ValueError: any option out of its range, named, before the model is read
      (:func:`~jaxprune.clicktrain._dispatch.check_dispatch_options`: a threshold outside
      [0, 1], ``"pallas"`` where this JAX has no Pallas Triton backend, ``repeats < 1``, an
      unknown ``filter_groups`` name, ``check_model`` without measuring, bad ``columns``);
      a mask whose shape or content does not fit its kernel (named), a masked conv that is
      already sparse or missing from a ``filter_groups`` mapping, or measuring without
      ``input_shape``.
  """
  check_dispatch_options(
    threshold=threshold,
    backend=backend,
    nnz_per_kernel=nnz_per_kernel,
    input_shape=input_shape,
    repeats=repeats,
    filter_groups=filter_groups,
    check_model=check_model,
    columns=columns,
  )
  backend = default_backend() if backend is None else backend
  threshold = default_threshold() if threshold is None else threshold
  if threshold == "fixed":
    threshold = fixed_threshold()
  measure = isinstance(threshold, str)
  check_model = measure if check_model is None else check_model
  if measure:
    if input_shape is None:
      raise ValueError("input_shape: threshold='measure' needs the model's input shape")
    traced = {
      layer.param_path: layer
      for layer in flops.layer_flops(model, tuple(input_shape))
      if layer.kind == "conv" and layer.param_path is not None
    }
  else:
    threshold = float(threshold)
  masks_by_path = {path: np.asarray(m) for path, m in flatten_with_paths(weight_masks)}
  choices: list[LayerChoice] = []
  builds = {}  # path -> (label, build(conv)) of every masked conv's sparse layer
  convertible = []  # the masked convs a sparse layer can replace
  timed: dict[tuple, tuple[float, dict]] = {}  # one measurement per geometry and sparsity
  for path, module in nnx.iter_modules(model):
    if not isinstance(module, nnx.Conv):
      continue
    mask = masks_by_path.get(tuple(path) + ("kernel",))
    if mask is None:
      continue
    name = "/".join(map(str, path))
    if isinstance(module, (PatternConv, AlignedConv)):
      raise ValueError(f"weight_masks: {name} is already a {type(module).__name__}")
    if mask.shape != tuple(module.kernel.shape):
      raise ValueError(
        f"weight_masks: mask of {name} has shape {mask.shape}, kernel {module.kernel.shape}"
      )
    groups = filter_groups
    if isinstance(filter_groups, Mapping):
      groups = filter_groups.get(f"{name}/kernel")
      if groups is None:
        raise ValueError(f"filter_groups: no groups for the masked kernel {name}/kernel")
    sparsity, balanced, variants, timing_key = _sparse_layer(
      mask, name, groups, nnz_per_kernel, backend, columns
    )
    label = next(iter(variants))
    dense_ms = sparse_ms = None
    if measure:
      layer = traced[tuple(path) + ("kernel",)]
      strides = tuple(layer.strides)
      pad = tuple(tuple(p) for p in layer.padding)
      # Timed in the conv's compute dtype (a bfloat16 model's layers run in bfloat16); the
      # mask is cast to it, or it would promote the dense conv to float32.
      dtype = jnp.dtype(module.dtype if module.dtype is not None else jnp.float32)
      key = (mask.shape, tuple(layer.input_shape), strides, pad, int(mask.sum()), dtype)
      key += (tuple(variants), timing_key)
      if key not in timed:
        kernel = jnp.asarray(np.random.default_rng(0).normal(size=mask.shape) * mask, dtype)
        kept = jnp.asarray(mask, dtype)

        def dense(x, w):
          return lax.conv_general_dilated(x, w * kept, strides, pad, dimension_numbers=_NHWC)

        timed[key] = (
          time_train_pass(dense, layer.input_shape, kernel, repeats=repeats),
          {
            v: time_train_pass(fn(strides, pad), layer.input_shape, kernel, repeats=repeats)
            for v, (_, fn) in variants.items()
          },
        )
      dense_ms, sparse_times = timed[key]
      label = min(sparse_times, key=sparse_times.get)  # the fastest way to run it sparse
      sparse_ms = sparse_times[label]
      use = label if sparse_ms < dense_ms else "dense"
    else:
      use = label if sparsity > threshold else "dense"
    if not path:
      raise ValueError("model: pass a model containing convs, not a conv itself")
    builds[tuple(path)] = (label, variants[label][0])
    try:  # an unconvertible conv raises where chosen, and is never in "all sparse"
      check_convertible(module, name)
      convertible.append(tuple(path))
    except ValueError:
      pass
    choices.append(
      LayerChoice(name, tuple(module.kernel.shape), sparsity, balanced, use, dense_ms, sparse_ms)
    )
  paths = list(builds)
  chosen = [p for p, c in zip(paths, choices) if c.backend != "dense"]
  report = ConversionReport(choices)
  if check_model and chosen:
    chosen, report = _check_model(model, builds, chosen, convertible, choices, input_shape, repeats)
  for path in chosen:  # (build checks that the conv can be replaced)
    replace_submodule(model, path, builds[path][1](submodule(model, path)))
  return model, report


def _check_model(model, builds, chosen, convertible, choices, input_shape, repeats):
  """The whole-model check of :func:`convert_model`: the fastest of all dense, the per-layer
  choice and all sparse (every ``convertible`` conv; each timed on a copy of ``model``), and
  the choices it leaves."""
  candidates = {"per-layer": chosen, "all sparse": convertible, "dense": []}
  distinct = {}
  for label, paths in candidates.items():
    if paths not in distinct.values():
      distinct[label] = paths
  model_ms = {}
  for label, paths in distinct.items():
    trial = nnx.clone(model)
    for path in paths:
      replace_submodule(trial, path, builds[path][1](submodule(trial, path)))
    model_ms[label] = time_model_pass(trial, input_shape, repeats=repeats)
  kept = min(model_ms, key=model_ms.get)
  final = distinct[kept]
  out = []
  for path, c in zip(builds, choices):
    use = builds[path][0] if path in final else "dense"
    out.append(
      c if use == c.backend else dataclasses.replace(c, backend=use, layer_backend=c.backend)
    )
  return final, ConversionReport(out, model_ms, kept)


def pattern_convs(model: nnx.Module) -> dict[str, PatternConv | AlignedConv]:
  """The sparse layers (``PatternConv`` and ``AlignedConv``) of ``model`` by path."""
  return {
    "/".join(map(str, p)): m
    for p, m in nnx.iter_modules(model)
    if isinstance(m, (PatternConv, AlignedConv))
  }


def format_report(choices: list[LayerChoice]) -> str:
  """A markdown table of :func:`convert_model`'s per-layer choices."""
  lines = [
    "| layer | kernel | sparsity | balanced | dense / sparse ms | path |",
    "|---|---|---:|---|---:|---|",
  ]
  for c in choices:
    times = "–" if c.dense_ms is None else f"{c.dense_ms:.2f} / {c.sparse_ms:.2f}"
    lines.append(
      f"| `{c.path}` | {'×'.join(map(str, c.kernel_shape))} | {c.sparsity:.1%} "
      f"| {'yes' if c.balanced else 'no'} | {times} | {c.backend} |"
    )
  model_ms = getattr(choices, "model_ms", None)
  if model_ms:
    times = ", ".join(f"{label} {ms:.2f} ms" for label, ms in model_ms.items())
    lines += ["", f"Whole model (forward + backward): {times}; kept: {choices.kept}."]
  return "\n".join(lines)


class SparseExecution(Callback):
  """Trainer hook: switch the pruned convs to a sparse layer once the masks are final.

  At the first epoch end where ClickTrain's stage is ``"pruned"`` and the pruned weights are
  exactly zero (the epoch end at which the stage changes: the step entering it zeroes them;
  weights that are not zero there, e.g. re-filled by a transform chained after ClickTrain,
  would make the dense and the sparse model compute different functions), and on a resumed run
  when the fit starts, it runs :func:`convert_model` on the trainer's model with the masks from
  the optimizer state and installs it (one recompilation). Later epochs do nothing, unless the
  trainer's model was replaced (a PruneTrain reconfiguration rebuilds it dense): the new model
  is converted with its sliced masks.

  Args:
    threshold, backend, nnz_per_kernel, repeats, filter_groups, check_model, columns: as
      :func:`convert_model` (by default every layer is timed both ways once, at the
      conversion, then the whole model three ways); and
      ``filter_groups="from_state"``: each layer's groups as the ClickTrain state holds them
      (:func:`~jaxprune.clicktrain.filter_partition`, read at every conversion, so a resumed or
      reconfigured run uses its own), what ``filter_grouping="clustered"`` needs.
    input_shape: the input batch shape to time the layers at; default: the training loader's
      batch size and ``dataset.image_shape`` (a ``jaxprune.data.Loader``), read each epoch.

  Raises:
    ValueError: an option :func:`convert_model` would refuse, named, when the hook is built
      (not at the hard prune): e.g. ``filter_groups="from-state"``, ``threshold="measured"``
      or ``1.5``, ``repeats=0``.

  Attributes:
    choices: the per-layer decisions (a :class:`ConversionReport`), once converted.

  Example::

    trainer = train.Trainer(model, clicktrain.clicktrain(inner, ...),
                            callbacks=[SparseExecution()])
  """

  def __init__(
    self,
    *,
    threshold: float | str | None = None,
    backend: str | None = None,
    nnz_per_kernel: int | None = 4,
    input_shape: Sequence[int] | None = None,
    repeats: int = 3,
    filter_groups: Any = None,
    check_model: bool | None = None,
    columns: str | None = None,
  ):
    # Checked here, not at the hard prune hours later (ClickTrain §5.2 converts once).
    check_dispatch_options(
      threshold=threshold,
      backend=backend,
      nnz_per_kernel=nnz_per_kernel,
      input_shape=input_shape,
      repeats=repeats,
      filter_groups=filter_groups,
      check_model=check_model,
      columns=columns,
      from_state=True,
    )
    self.threshold = threshold
    self.backend = backend
    self.nnz_per_kernel = nnz_per_kernel
    self.input_shape = None if input_shape is None else tuple(input_shape)
    self.repeats = repeats
    self.filter_groups = filter_groups
    self.check_model = check_model
    self.columns = columns
    self.choices: ConversionReport | None = None
    self._loader_shape: tuple[int, ...] | None = None
    # The model last converted: a model rebuilt since (PruneTrain's reconfiguration) is
    # converted again, with the sliced masks.
    self._converted: nnx.Module | None = None

  def _measures(self) -> bool:
    return (default_threshold() if self.threshold is None else self.threshold) == "measure"

  def _input_shape(self) -> tuple[int, ...] | None:
    return self.input_shape or self._loader_shape

  def _convert(self, trainer: Any) -> None:
    model = trainer.model
    if model is self._converted or stage_name(trainer.opt_state) != "pruned":
      return
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    weight_masks = masks(trainer.opt_state, params)
    if count_refilled(weight_masks, params)[0]:
      return  # pruned weights re-filled: the sparse model would compute another function
    threshold = self.threshold
    if self._measures() and self._input_shape() is None:
      raise ValueError(
        "input_shape: SparseExecution measures each layer by default and needs the input "
        "batch shape: pass input_shape=, train with a jaxprune.data.Loader, or set a threshold"
      )
    model, self.choices = convert_model(
      model,
      weight_masks,
      threshold=threshold,
      backend=self.backend,
      nnz_per_kernel=self.nnz_per_kernel,
      input_shape=self._input_shape(),
      repeats=self.repeats,
      filter_groups=(
        filter_partition(trainer.opt_state)
        if isinstance(self.filter_groups, str) and self.filter_groups == "from_state"
        else self.filter_groups
      ),
      check_model=self.check_model,
      columns=self.columns,
    )
    trainer.replace(model, trainer.opt_state)
    self._converted = model

  def on_fit_start(self, trainer: Any) -> None:
    if self._measures() and self._input_shape() is None:
      # A resumed run converts at its first epoch end, once the loader's shape is known (its
      # first epoch runs the masked dense convs: pass input_shape to switch at once).
      return
    self._convert(trainer)

  def on_train_epoch_end(self, trainer: Any, epoch: int, train_loader: Any) -> None:
    del trainer, epoch
    shape = getattr(getattr(train_loader, "dataset", None), "image_shape", None)
    size = getattr(train_loader, "batch_size", None)
    if shape is not None and size:
      self._loader_shape = (int(size), *(int(d) for d in shape))

  def on_epoch_end(self, trainer: Any, epoch: int) -> Mapping[str, Any]:
    del epoch
    self._convert(trainer)
    # In every record: the layers that run sparse from the next epoch on (0 before the switch).
    running = trainer.model is self._converted and self.choices is not None
    return {"sparse_layers": sum(c.backend != "dense" for c in self.choices) if running else 0}

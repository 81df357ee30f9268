"""Per-layer sparse execution of a pattern-pruned model (ClickTrain §5.2, §5.4).

After the hard prune ClickTrain's masks never change, so the execution of each pruned conv is
decided **once**: it becomes a
:class:`~jaxprune.clicktrain.execution.sparse_layers.PatternConv` (the paper's fine-grained
layout, §5.1) or, for masks of the aligned mode, an
:class:`~jaxprune.clicktrain.execution.sparse_layers.AlignedConv`, or stays an ordinary conv whose
pruned weights ClickTrain's masks keep at zero. There is no per-step branching: the choice is
part of the model's structure, compiled once.

**By default each layer is timed both ways** (forward and both gradients, at its real input
shape, once per conversion) and keeps the faster: on a GPU the fine-grained kernels are slower
than cuDNN per layer, and a whole step with every pruned conv sparse is slower than the dense
masked step; on the CPU the reference SpMM also loses at ClickTrain's sparsities; the aligned
layout wins on some layers and loses on others on both (measured in ``docs/design.md``, "Sparse
execution", and ``experiments/results/benchmarks/aligned_bench_gpu.md``,
``aligned_bench_cpu.md`` and ``pattern_conv_bench.md``). Layers timed in isolation do not add up
to a step (on the GPU the per-layer choice made VGG-11's step slower than all-dense or
all-aligned), so the dispatch then times **the whole model's training pass** all dense, as the
layers chose and all sparse, and keeps the fastest (:class:`ConversionReport`). A fixed
threshold (the paper's 65% on its GPU, §5.2) stays.

The layout is a static attribute of the layer, not part of its state: a checkpoint holds the
same arrays before and after the switch, and a resumed run rebuilds the layouts from the masks
in the optimizer state (:class:`~jaxprune.clicktrain.execution.hook.SparseExecution` does
this when a fit starts).

:func:`plan_sparse_layers` decides (and times) without touching the model;
:func:`apply_sparse_layers` swaps the layers; :func:`to_sparse_layers` does both.

Example::

  weight_masks = clicktrain.masks(opt_state, nnx.state(model, nnx.Param))
  model, report = to_sparse_layers(model, weight_masks, input_shape=(128, 32, 32, 3))
  print(format_report(report))

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxprune import flops
from jaxprune.clicktrain.execution.aligned_conv import COLUMNS, aligned_conv, shared_columns
from jaxprune.clicktrain.execution.aligned_layout import build_aligned_layout
from jaxprune.clicktrain.execution.layer_timing import time_model_pass, time_train_pass
from jaxprune.clicktrain.execution.options import SparseExecutionConfig, as_config
from jaxprune.clicktrain.execution.pattern_conv import pattern_conv
from jaxprune.clicktrain.execution.pattern_layout import build_layout
from jaxprune.clicktrain.execution.sparse_layers import AlignedConv, PatternConv, check_convertible
from jaxprune.models import replace_submodule, submodule
from jaxprune.paths import flatten_with_paths

__all__ = [
  "ConversionReport",
  "LayerChoice",
  "apply_sparse_layers",
  "convert_model",
  "format_report",
  "pattern_convs",
  "plan_sparse_layers",
  "to_sparse_layers",
]

_NHWC = ("NHWC", "HWIO", "NHWC")


class ConversionReport(list):
  """:func:`plan_sparse_layers`' per-layer :class:`LayerChoice` list, with the whole-model check.

  The plan :func:`apply_sparse_layers` carries out.

  Attributes:
    model_ms: the measured training pass of the whole model (:func:`time_model_pass`) per
      candidate: ``"dense"`` (no layer switched), ``"per-layer"`` (each layer on its own
      faster path) and ``"all sparse"`` (every pruned conv switched), those that differ; empty
      when the check did not run (a fixed threshold, no layer faster sparse, or turned off).
    kept: the candidate kept (the fastest), or ``None`` when the check did not run.
    builds: per masked conv, in the choices' order, its path (a tuple) and ``(label,
      build(conv) -> layer)`` of its fastest sparse way; empty in a report built by hand.
  """

  def __init__(
    self,
    choices=(),
    model_ms: Mapping[str, float] | None = None,
    kept=None,
    *,
    builds: Mapping[tuple, tuple[str, Callable[[nnx.Conv], nnx.Module]]] | None = None,
  ):
    super().__init__(choices)
    self.model_ms = dict(model_ms or {})
    self.kept = kept
    self.builds = dict(builds or {})

  def sparse_paths(self) -> list[tuple]:
    """The paths of the convs this plan runs sparse, in model order."""
    return [path for path, c in zip(self.builds, self) if c.backend != "dense"]


@dataclasses.dataclass(frozen=True)
class LayerChoice:
  """What :func:`plan_sparse_layers` decided for one pruned conv.

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


def _traced_convs(model: nnx.Module, input_shape: Sequence[int]) -> dict[tuple, Any]:
  """Each conv's traced geometry (input shape, strides, padding) by its kernel's path."""
  return {
    layer.param_path: layer
    for layer in flops.layer_flops(model, tuple(input_shape))
    if layer.kind == "conv" and layer.param_path is not None
  }


class _LayerTimer:
  """The per-layer autotuner: times a masked conv dense and every sparse way it can run, once
  per geometry, sparsity and dtype (a network repeats its layer shapes)."""

  def __init__(self, repeats: int):
    self.repeats = repeats
    self._timed: dict[tuple, tuple[float, dict[str, float]]] = {}

  def __call__(self, module, mask, traced, variants, timing_key):
    """``(dense_ms, {label: sparse_ms})`` of one conv at its traced geometry."""
    strides = tuple(traced.strides)
    pad = tuple(tuple(p) for p in traced.padding)
    # Timed in the conv's compute dtype (a bfloat16 model's layers run in bfloat16); the mask
    # is cast to it, or it would promote the dense conv to float32.
    dtype = jnp.dtype(module.dtype if module.dtype is not None else jnp.float32)
    key = (mask.shape, tuple(traced.input_shape), strides, pad, int(mask.sum()), dtype)
    key += (tuple(variants), timing_key)
    if key not in self._timed:
      kernel = jnp.asarray(np.random.default_rng(0).normal(size=mask.shape) * mask, dtype)
      kept = jnp.asarray(mask, dtype)

      def dense(x, w):
        return lax.conv_general_dilated(x, w * kept, strides, pad, dimension_numbers=_NHWC)

      shape, repeats = traced.input_shape, self.repeats
      self._timed[key] = (
        time_train_pass(dense, shape, kernel, repeats=repeats),
        {
          v: time_train_pass(fn(strides, pad), shape, kernel, repeats=repeats)
          for v, (_, fn) in variants.items()
        },
      )
    return self._timed[key]


def _layer_groups(filter_groups: Any, name: str):
  """The groups of the masked conv ``name`` under ``filter_groups`` (one setting or a mapping)."""
  if not isinstance(filter_groups, Mapping):
    return filter_groups
  groups = filter_groups.get(f"{name}/kernel")
  if groups is None:
    raise ValueError(f"filter_groups: no groups for the masked kernel {name}/kernel")
  return groups


def plan_sparse_layers(
  model: nnx.Module, weight_masks: Any, config: SparseExecutionConfig
) -> ConversionReport:
  """Decides, for every masked conv of ``model``, whether it runs sparse and how (not in place).

  Args:
    model: an NNX model (read, not changed; the whole-model check times copies).
    weight_masks: a pytree like ``nnx.state(model, nnx.Param)`` with a 0/1 mask for every
      pruned conv kernel and ``None`` elsewhere (``jaxprune.clicktrain.masks(opt_state,
      params)``).
    config: the options (:class:`SparseExecutionConfig`).

  Returns:
    A :class:`ConversionReport`: one :class:`LayerChoice` per masked conv in model order, the
    whole-model times, and what :func:`apply_sparse_layers` needs to build the layers.

  Raises:
    ValueError: ``filter_groups="from_state"`` (there is no optimizer state here); a mask
      whose shape or content does not fit its kernel (named), a masked conv that is already
      sparse or missing from a ``filter_groups`` mapping, or measuring without
      ``input_shape``.
  """
  if isinstance(config.filter_groups, str) and config.filter_groups == "from_state":
    raise ValueError(
      "filter_groups must be None, 'auto', a group count, groups or a mapping of them here, "
      "got 'from_state' (no optimizer state: pass clicktrain.filter_partition(opt_state), or "
      "use SparseExecution)"
    )
  measure = config.measures()
  if measure and config.input_shape is None:
    raise ValueError("input_shape: threshold='measure' needs the model's input shape")
  traced = _traced_convs(model, config.input_shape) if measure else {}
  timer = _LayerTimer(config.repeats)
  backend = config.sparse_backend()
  masks_by_path = {path: np.asarray(m) for path, m in flatten_with_paths(weight_masks)}
  choices: list[LayerChoice] = []
  builds = {}  # path -> (label, build(conv)) of every masked conv's sparse layer
  convertible = []  # the masked convs a sparse layer can replace
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
    groups = _layer_groups(config.filter_groups, name)
    sparsity, balanced, variants, timing_key = _sparse_layer(
      mask, name, groups, config.nnz_per_kernel, backend, config.columns
    )
    label = next(iter(variants))
    dense_ms = sparse_ms = None
    if measure:
      traced_conv = traced[tuple(path) + ("kernel",)]
      dense_ms, sparse_times = timer(module, mask, traced_conv, variants, timing_key)
      label = min(sparse_times, key=sparse_times.get)  # the fastest way to run it sparse
      sparse_ms = sparse_times[label]
      use = label if sparse_ms < dense_ms else "dense"
    else:
      use = label if sparsity > config.fixed_sparsity() else "dense"
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
  report = ConversionReport(choices, builds=builds)
  if config.checks_model() and any(c.backend != "dense" for c in choices):
    report = _check_model(model, report, convertible, config)
  return report


def apply_sparse_layers(model: nnx.Module, report: ConversionReport) -> nnx.Module:
  """Swaps the convs ``report`` runs sparse for their sparse layers, in place.

  Args:
    model: the model :func:`plan_sparse_layers` read (mutated in place and returned).
    report: its plan.

  Returns:
    ``model``, its chosen convs replaced by :class:`PatternConv` / :class:`AlignedConv` layers
    sharing their Variables.

  Raises:
    ValueError: a conv the sparse layer cannot replace (grouped, dilated, its own mask).
  """
  for path in report.sparse_paths():  # (each build checks that its conv can be replaced)
    replace_submodule(model, path, report.builds[path][1](submodule(model, path)))
  return model


def to_sparse_layers(
  model: nnx.Module,
  weight_masks: Any,
  config: SparseExecutionConfig | None = None,
  /,
  **options: Any,
) -> tuple[nnx.Module, ConversionReport]:
  """Switches the pruned convs of ``model`` to sparse layers where it pays, in place.

  :func:`plan_sparse_layers` then :func:`apply_sparse_layers`.

  Args:
    model: an NNX model (mutated in place and returned).
    weight_masks: a 0/1 mask for every pruned conv kernel, ``None`` elsewhere (a pytree like
      ``nnx.state(model, nnx.Param)``: ``jaxprune.clicktrain.masks(opt_state, params)``).
    config: a :class:`SparseExecutionConfig`; or
    **options: its fields (``threshold``, ``backend``, ``nnz_per_kernel``, ``input_shape``,
      ``repeats``, ``filter_groups``, ``check_model``, ``columns``), checked before the model is
      read.

  Returns:
    ``(model, report)``: a :class:`ConversionReport`, one :class:`LayerChoice` per masked conv
    in model order, with the whole-model times.

  Raises:
    ValueError: any option out of its range, named, before the model is read (see
      :class:`SparseExecutionConfig`), both a config and options; or as
      :func:`plan_sparse_layers` and :func:`apply_sparse_layers`.
  """
  report = plan_sparse_layers(model, weight_masks, as_config(config, options))
  return apply_sparse_layers(model, report), report


def convert_model(*args: Any, **kwargs: Any) -> tuple[nnx.Module, ConversionReport]:
  """Deprecated name of :func:`to_sparse_layers` (same arguments and result)."""
  warnings.warn(
    "jaxprune.clicktrain.convert_model is deprecated and will be removed in the next release; "
    "use to_sparse_layers",
    DeprecationWarning,
    stacklevel=2,
  )
  return to_sparse_layers(*args, **kwargs)


def _check_model(model, report, convertible, config):
  """The whole-model check of :func:`plan_sparse_layers`: the fastest of all dense, the
  per-layer choice and all sparse (every ``convertible`` conv; each timed on a copy of
  ``model``), as a new report."""
  builds = report.builds
  chosen = [p for p, c in zip(builds, report) if c.backend != "dense"]
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
    model_ms[label] = time_model_pass(trial, config.input_shape, repeats=config.repeats)
  kept = min(model_ms, key=model_ms.get)
  final = distinct[kept]
  out = []
  for path, c in zip(builds, report):
    use = builds[path][0] if path in final else "dense"
    out.append(
      c if use == c.backend else dataclasses.replace(c, backend=use, layer_backend=c.backend)
    )
  return ConversionReport(out, model_ms, kept, builds=builds)


def pattern_convs(model: nnx.Module) -> dict[str, PatternConv | AlignedConv]:
  """The sparse layers (``PatternConv`` and ``AlignedConv``) of ``model`` by path."""
  return {
    "/".join(map(str, p)): m
    for p, m in nnx.iter_modules(model)
    if isinstance(m, (PatternConv, AlignedConv))
  }


def format_report(choices: list[LayerChoice]) -> str:
  """A markdown table of :func:`plan_sparse_layers`' per-layer choices."""
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

"""Per-layer sparse execution of a pattern-pruned model (ClickTrain §5.2, §5.4).

After the hard prune ClickTrain's masks never change, so the sparse path is decided **once**:
each pruned convolution whose sparsity is above a threshold becomes a :class:`PatternConv`
that holds its fixed-position layout (built once from the mask, §5.1) and runs
:func:`jaxprune.clicktrain.pattern_conv.pattern_conv`; the others stay ordinary ``nnx.Conv``
layers (their pruned weights are kept at zero by ClickTrain's masks). There is no per-step
branching: the choice is part of the model's structure, and a new structure is compiled once.

The paper's threshold is 65% sparsity on its GPU (below it the dense cuDNN convolution is
faster, §5.2 "Forward Phase Acceleration"). On other platforms the right threshold is what a
measurement on that platform says (``python -m experiments.run pattern_conv_bench``); the
defaults in :data:`DEFAULT_THRESHOLDS` follow those measurements.

The layout is a static attribute of the layer, not part of its state: a checkpoint holds the
same arrays before and after the switch, and a resumed run rebuilds the layouts from the
masks that ClickTrain keeps in the optimizer state (:class:`SparseExecution` does this when a
fit starts).

Example::

  weight_masks = clicktrain.masks(opt_state, nnx.state(model, nnx.Param))
  model, report = convert_model(model, weight_masks)        # in place; report per layer
  print(format_report(report))

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from flax import nnx

from jaxprune import flops
from jaxprune.clicktrain.readouts import masks, stage_name
from jaxprune.clicktrain.layout import PatternLayout, build_layout, to_dense, to_values
from jaxprune.clicktrain.pattern_conv import (
  BACKENDS,
  canonical_padding,
  pattern_conv,
  pattern_conv_values,
)
from jaxprune.masking import count_refilled
from jaxprune.models import (
  PluggableConv,
  base_function,
  conv_sharing_variables,
  replace_submodule,
  with_base,
)
from jaxprune.paths import flatten_with_paths
from jaxprune.train import Callback

__all__ = [
  "DEFAULT_THRESHOLDS",
  "LayerChoice",
  "PatternConv",
  "SparseExecution",
  "convert_model",
  "default_backend",
  "default_threshold",
  "format_report",
  "median_call_ms",
  "pattern_convs",
  "time_layer",
]

# Sparsity above which a layer runs the sparse path, per platform. GPU: the paper's 65%
# (§5.2). CPU: the reference SpMM (one gather per kept column) is slower than XLA's dense
# convolution at every ClickTrain sparsity we measured, so the CPU default keeps every layer
# dense (a threshold above 1 is never reached).
DEFAULT_THRESHOLDS = {"gpu": 0.65, "cpu": 1.01}


def default_threshold(platform: str | None = None) -> float:
  """The sparsity threshold of ``platform`` (default: the default backend's platform)."""
  platform = platform or jax.default_backend()
  return DEFAULT_THRESHOLDS.get(platform, DEFAULT_THRESHOLDS["cpu"])


def default_backend(platform: str | None = None) -> str:
  """The sparse kernel used on ``platform``: the Pallas kernels on GPU when available."""
  platform = platform or jax.default_backend()
  if platform == "gpu" and "pallas" in BACKENDS:
    return "pallas"
  return "reference"


class _StaticLayout:
  """Holds a layout as a static (graph-definition) attribute: never a state leaf."""

  def __init__(self, layout: PatternLayout):
    self.layout = layout

  def __repr__(self) -> str:
    return f"PatternLayout(kernel_shape={self.layout.kernel_shape}, width={self.layout.width})"


def _conv_padding(conv: nnx.Conv, name: str):
  try:
    return canonical_padding(conv.padding)
  except ValueError as err:
    raise ValueError(f"{name}: {err} (PatternConv)") from None


def _check_convertible(conv: nnx.Conv, name: str) -> None:
  if len(conv.kernel_size) != 2:
    raise ValueError(f"{name}: PatternConv handles 2-D convolutions, got {conv.kernel_size}")
  if conv.feature_group_count != 1:
    raise ValueError(f"{name}: grouped convolutions are not supported by PatternConv")
  for attr in ("input_dilation", "kernel_dilation"):
    value = getattr(conv, attr)
    if value not in (None, 1) and tuple(np.broadcast_to(value, (2,))) != (1, 1):
      raise ValueError(f"{name}: {attr} {value!r} is not supported by PatternConv")
  if conv.mask is not None:
    raise ValueError(f"{name}: a conv with its own weight mask is not supported by PatternConv")
  _conv_padding(conv, name)


@dataclasses.dataclass(frozen=True)
class _PatternConvFunction:
  """:func:`pattern_conv` on a fixed layout as a conv function of the shared protocol
  (:mod:`jaxprune.models.pluggable_conv`): the innermost function of a ``PatternConv``, under
  any wrapper its conv had (e.g. SDGP's pruned data gradient)."""

  holder: _StaticLayout
  backend: str

  def __call__(self, lhs, rhs, window_strides, padding, **geometry) -> jax.Array:
    # Dilation, groups and layout are checked once, when the conv is converted
    # (`_check_convertible`); pattern_conv is NHWC × HWIO without them.
    del geometry
    return pattern_conv(
      lhs, rhs, self.holder.layout, strides=window_strides, padding=padding, backend=self.backend
    )


class PatternConv(PluggableConv):
  """``nnx.Conv`` whose kernel is pattern-sparse on a fixed layout (ClickTrain §5.2).

  Same parameters (``kernel``, ``bias``: the very Variables of the conv it replaces) and the
  same function as that conv with its pruned weights at zero; the convolution runs
  :func:`~jaxprune.clicktrain.pattern_conv.pattern_conv` with ``backend``.

  The sparse convolution replaces the innermost conv function of the conv it comes from
  (:func:`jaxprune.models.with_base`) and keeps every wrapper around it, with the layer's
  key Variable: converted from an SDGP conv, it keeps SDGP's backward pass (the weight
  gradient from the dense output gradient, the data gradient from the N:M-pruned one, both
  through the sparse path) without this package knowing SDGP.

  Build it with :meth:`from_conv`; :func:`convert_model` does it for a whole model.
  """

  @classmethod
  def from_conv(
    cls, conv: nnx.Conv, layout: PatternLayout, *, backend: str = "reference", name: str = "conv"
  ) -> PatternConv:
    """A ``PatternConv`` sharing ``conv``'s Variables, running on ``layout``.

    Raises:
      ValueError: an unknown backend, a layout of another kernel shape, or a conv that the
        sparse path cannot run (grouped, dilated, circular padding, its own mask).
    """
    if backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(conv, PatternConv):
      raise ValueError(f"{name}: conv is already a PatternConv")
    _check_convertible(conv, name)
    if tuple(layout.kernel_shape) != tuple(conv.kernel.shape):
      raise ValueError(
        f"{name}: layout kernel shape {layout.kernel_shape} != conv kernel {conv.kernel.shape}"
      )
    sparse = _PatternConvFunction(_StaticLayout(layout), backend)
    return conv_sharing_variables(
      cls, conv, conv_general_dilated=with_base(conv.conv_general_dilated, sparse)
    )

  @property
  def layout(self) -> PatternLayout:
    return base_function(self.conv_general_dilated).holder.layout

  @property
  def backend(self) -> str:
    return base_function(self.conv_general_dilated).backend


def median_call_ms(fn, *args, repeats: int) -> float:
  """Median wall-clock milliseconds of ``fn(*args)`` over ``repeats`` calls after a warm-up."""
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def time_layer(
  layout: PatternLayout,
  input_shape: Sequence[int],
  *,
  strides=(1, 1),
  padding="SAME",
  backend: str = "reference",
  repeats: int = 3,
  seed: int = 0,
) -> dict[str, float]:
  """Wall-clock milliseconds of one conv, sparse path against the dense masked conv.

  Times, on the default device, the forward pass, the data gradient and the weight gradient
  of :func:`~jaxprune.clicktrain.pattern_conv.pattern_conv_values` with ``backend`` and of
  ``lax.conv_general_dilated`` with the masked kernel, each the median of ``repeats`` calls of
  the jitted function after a warm-up call (so compilation is not counted).

  Returns:
    ``dense_fwd_ms``, ``sparse_fwd_ms``, ``dense_dx_ms``, ``sparse_dx_ms``, ``dense_dw_ms``,
    ``sparse_dw_ms``.
  """
  rng = np.random.default_rng(seed)
  mask = np.asarray(to_dense(jnp.ones((layout.kernel_shape[3], layout.width)), layout))
  kernel = jnp.asarray(rng.normal(size=layout.kernel_shape) * mask, jnp.float32)
  values = to_values(kernel, layout)
  x = jnp.asarray(rng.normal(size=tuple(input_shape)), jnp.float32)
  strides = (strides, strides) if isinstance(strides, int) else tuple(strides)
  pad = padding if isinstance(padding, str) else tuple(tuple(p) for p in padding)

  def dense(x, w):
    return lax.conv_general_dilated(x, w, strides, pad, dimension_numbers=("NHWC", "HWIO", "NHWC"))

  def sparse(x, v):
    return pattern_conv_values(x, v, layout, strides=strides, padding=pad, backend=backend)

  cot = jnp.asarray(rng.normal(size=jax.eval_shape(dense, x, kernel).shape), jnp.float32)

  def grad(f, argnum):
    return jax.jit(lambda x, w, c: jax.vjp(f, x, w)[1](c)[argnum])

  return {
    "dense_fwd_ms": median_call_ms(jax.jit(dense), x, kernel, repeats=repeats),
    "sparse_fwd_ms": median_call_ms(jax.jit(sparse), x, values, repeats=repeats),
    "dense_dx_ms": median_call_ms(grad(dense, 0), x, kernel, cot, repeats=repeats),
    "sparse_dx_ms": median_call_ms(grad(sparse, 0), x, values, cot, repeats=repeats),
    "dense_dw_ms": median_call_ms(grad(dense, 1), x, kernel, cot, repeats=repeats),
    "sparse_dw_ms": median_call_ms(grad(sparse, 1), x, values, cot, repeats=repeats),
  }


def _total(times: Mapping[str, float], path: str) -> float:
  return sum(times[f"{path}_{part}_ms"] for part in ("fwd", "dx", "dw"))


@dataclasses.dataclass(frozen=True)
class LayerChoice:
  """What :func:`convert_model` decided for one pruned conv.

  Attributes:
    path: the conv's path in the model (``"/"``-joined).
    kernel_shape: its HWIO kernel shape.
    sparsity: fraction of zero weights under its mask.
    balanced: every filter keeps the same number of weights.
    backend: ``"dense"`` (left an ``nnx.Conv``) or the sparse backend it runs.
    dense_ms, sparse_ms: measured forward + backward times (``threshold="measure"`` only).
  """

  path: str
  kernel_shape: tuple[int, ...]
  sparsity: float
  balanced: bool
  backend: str
  dense_ms: float | None = None
  sparse_ms: float | None = None


def convert_model(
  model: nnx.Module,
  weight_masks: Any,
  *,
  threshold: float | str | None = None,
  backend: str | None = None,
  nnz_per_kernel: int | None = 4,
  input_shape: Sequence[int] | None = None,
  repeats: int = 3,
) -> tuple[nnx.Module, list[LayerChoice]]:
  """Switches the pruned convs of ``model`` to the sparse path where it pays, in place.

  Args:
    model: an NNX model (mutated in place and returned).
    weight_masks: a pytree like ``nnx.state(model, nnx.Param)`` with a 0/1 mask for every
      pruned conv kernel and ``None`` elsewhere (``jaxprune.clicktrain.masks(opt_state,
      params)``).
    threshold: sparsity above which a layer runs the sparse path; default
      :func:`default_threshold` of the current platform. ``"measure"``: time each layer
      both ways at its real input shape (:func:`time_layer`, forward + both gradients) and
      keep the faster, which also catches what sparsity alone cannot (e.g. XLA:CPU's slow
      dense convolution on 2x2 feature maps).
    backend: the sparse backend; default :func:`default_backend`.
    nnz_per_kernel: weights per kept kernel the layouts enforce (4 for ClickTrain's
      patterns; a 1x1 kernel keeps its single weight); ``None`` accepts any pattern.

  Returns:
    ``(model, choices)``: one :class:`LayerChoice` per masked conv, in model order.

  Raises:
    ValueError: a mask whose shape or content does not fit its kernel (named), a masked
      conv that is already a ``PatternConv``, or a bad threshold / backend.
  """
  measure = isinstance(threshold, str)
  if measure:
    if threshold != "measure":
      raise ValueError(f"threshold must be a number or 'measure', got {threshold!r}")
    if input_shape is None:
      raise ValueError("input_shape: threshold='measure' needs the model's input shape")
    traced = {
      layer.param_path: layer
      for layer in flops.layer_flops(model, tuple(input_shape))
      if layer.kind == "conv" and layer.param_path is not None
    }
  else:
    threshold = default_threshold() if threshold is None else float(threshold)
    if not np.isfinite(threshold) or threshold < 0:
      raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
  backend = default_backend() if backend is None else backend
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  masks = {path: np.asarray(m) for path, m in flatten_with_paths(weight_masks)}  # None: unmasked
  choices: list[LayerChoice] = []
  swaps = []
  for path, module in nnx.iter_modules(model):
    if not isinstance(module, nnx.Conv):
      continue
    mask = masks.get(tuple(path) + ("kernel",))
    if mask is None:
      continue
    name = "/".join(map(str, path))
    if isinstance(module, PatternConv):
      raise ValueError(f"weight_masks: {name} is already a PatternConv")
    if mask.shape != tuple(module.kernel.shape):
      raise ValueError(
        f"weight_masks: mask of {name} has shape {mask.shape}, kernel {module.kernel.shape}"
      )
    try:
      kernel_size = mask.shape[0] * mask.shape[1]
      per_kernel = None if nnz_per_kernel is None else min(nnz_per_kernel, kernel_size)
      layout = build_layout(mask, nnz_per_kernel=per_kernel)
    except ValueError as err:
      raise ValueError(f"weight_masks: {name}: {err}") from None
    dense_ms = sparse_ms = None
    if measure:
      layer = traced[tuple(path) + ("kernel",)]
      times = time_layer(
        layout,
        layer.input_shape,
        strides=tuple(layer.strides),
        padding=tuple(tuple(p) for p in layer.padding),
        backend=backend,
        repeats=repeats,
      )
      dense_ms, sparse_ms = _total(times, "dense"), _total(times, "sparse")
      use = backend if sparse_ms < dense_ms else "dense"
    else:
      use = backend if layout.sparsity > threshold else "dense"
    if use != "dense":
      _check_convertible(module, name)
      swaps.append((tuple(path), PatternConv.from_conv(module, layout, backend=use, name=name)))
    choices.append(
      LayerChoice(
        name,
        tuple(module.kernel.shape),
        layout.sparsity,
        layout.balanced,
        use,
        dense_ms,
        sparse_ms,
      )
    )
  for path, new in swaps:
    if not path:
      raise ValueError("model: pass a model containing convs, not a conv itself")
    replace_submodule(model, path, new)
  return model, choices


def pattern_convs(model: nnx.Module) -> dict[str, PatternConv]:
  """The ``PatternConv`` layers of ``model`` by path."""
  return {
    "/".join(map(str, p)): m for p, m in nnx.iter_modules(model) if isinstance(m, PatternConv)
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
  return "\n".join(lines)


class SparseExecution(Callback):
  """Trainer hook: switch the pruned convs to the sparse path once the masks are final.

  At the first epoch end where ClickTrain's stage is ``"pruned"`` and the pruned weights are
  exactly zero (the epoch end at which the stage changes: the step entering it zeroes them;
  weights that are not zero there, e.g. re-filled by a transform chained after ClickTrain,
  would make the dense and the sparse model compute different functions), and
  on a resumed run when the fit starts, it runs :func:`convert_model` on the trainer's model with the masks
  from the optimizer state and installs it (one recompilation). Later epochs do nothing,
  unless the trainer's model was replaced (a PruneTrain reconfiguration rebuilds it dense):
  the new model is converted with its sliced masks.

  Args:
    threshold, backend, nnz_per_kernel, input_shape, repeats: as :func:`convert_model`
      (``threshold="measure"`` times every layer once, at the conversion).

  Attributes:
    choices: the per-layer decisions, once converted.

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
  ):
    if threshold == "measure" and input_shape is None:
      raise ValueError("input_shape: threshold='measure' needs the model's input shape")
    if backend is not None and backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    self.threshold = threshold
    self.backend = backend
    self.nnz_per_kernel = nnz_per_kernel
    self.input_shape = input_shape
    self.repeats = repeats
    self.choices: list[LayerChoice] | None = None
    # The model last converted: a model rebuilt since (PruneTrain's reconfiguration) is
    # converted again, with the sliced masks.
    self._converted: nnx.Module | None = None

  def _convert(self, trainer: Any) -> dict[str, Any] | None:
    model = trainer.model
    if model is self._converted or stage_name(trainer.opt_state) != "pruned":
      return None
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    weight_masks = masks(trainer.opt_state, params)
    if count_refilled(weight_masks, params)[0]:
      return None  # pruned weights re-filled: the sparse model would compute another function
    model, self.choices = convert_model(
      model,
      weight_masks,
      threshold=self.threshold,
      backend=self.backend,
      nnz_per_kernel=self.nnz_per_kernel,
      input_shape=self.input_shape,
      repeats=self.repeats,
    )
    trainer.replace(model, trainer.opt_state)
    self._converted = model
    return {"sparse_layers": sum(c.backend != "dense" for c in self.choices)}

  def on_fit_start(self, trainer: Any) -> None:
    self._convert(trainer)

  def on_epoch_end(self, trainer: Any, epoch: int) -> Mapping[str, Any] | None:
    del epoch
    return self._convert(trainer)

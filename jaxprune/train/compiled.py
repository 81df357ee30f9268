"""The compiled steps for one :class:`~jaxprune.train.StepSettings`: built once, on one device
or over a mesh, and their memory.

``step_functions(step_settings(model, tx, loss_fn, mesh=...))`` is the one way to get them:
the settings value is the cache key, so a model structure seen before (same graphdefs, same
``tx`` and ``loss_fn`` objects, same mesh and reduction indices) reuses the compiled
executables, e.g. when a run is resumed in the same process or several runs share one
optimizer.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxprune.train import data_parallel
from jaxprune.train.step import (
  Metrics,
  PerExampleLoss,
  ReductionIndices,
  StepFunctions,
  StepSettings,
  TrainState,
  default_loss,
)

__all__ = ["memory_bytes", "step_functions", "step_settings", "train_step_memory"]


def step_settings(
  model: nnx.Module,
  tx: optax.GradientTransformation,
  loss_fn: PerExampleLoss | None = None,
  *,
  mesh: Any = None,
  sync_batchnorm: bool = False,
  flip_tta: bool = False,
  donate: bool = True,
  skip_nonfinite: bool = True,
  indices: Any = None,
) -> StepSettings:
  """The :class:`~jaxprune.train.StepSettings` of ``model``'s structure (left in train mode).

  Args:
    model: the model (its structure: graphdefs, random streams).
    tx: the optimizer.
    loss_fn: per-example loss (``None``: :func:`~jaxprune.train.default_loss`).
    mesh: ``None`` (one device), ``"auto"`` or a mesh with a ``"batch"`` axis.
    sync_batchnorm: on a mesh, synchronised BatchNorm statistics
      (:mod:`jaxprune.train.data_parallel`).
    flip_tta: flip test-time augmentation in eval.
    donate: donate the states to the steps.
    skip_nonfinite: a non-finite step leaves params and optimizer state as they were.
    indices: on a mesh, the reduction's index arrays
      (:func:`jaxprune.distributed.mask_indices` of final masks); ``None``: dense.

  Returns:
    The settings, hashable: the cache key of :func:`step_functions`.
  """
  mesh = data_parallel.resolve_mesh(mesh)
  axis = data_parallel.BATCH_AXIS if mesh is not None and sync_batchnorm else None
  train_gd = data_parallel.train_graphdef(model, axis)
  model.eval()
  eval_gd = nnx.graphdef(model)
  model.train()
  return StepSettings(
    train_graphdef=train_gd,
    eval_graphdef=eval_gd,
    tx=tx,
    loss_fn=default_loss() if loss_fn is None else loss_fn,
    flip_tta=bool(flip_tta),
    donate=bool(donate),
    skip_nonfinite=bool(skip_nonfinite),
    mesh=mesh,
    rng_keys=data_parallel.rng_key_leaves(model) if mesh is not None else (),
    indices=ReductionIndices(indices),
  )


@functools.lru_cache(maxsize=32)
def step_functions(settings: StepSettings) -> StepFunctions:
  """The cached compiled steps for ``settings``.

  :class:`~jaxprune.train.StepFunctions` on one device,
  :class:`~jaxprune.train.data_parallel.DataParallelSteps` on ``settings.mesh``.
  """
  if settings.mesh is None:
    return StepFunctions(settings)
  return data_parallel.DataParallelSteps(settings)


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)


def memory_bytes(stats: Any) -> int:
  """Bytes a compiled executable needs.

  Arguments + outputs + temporaries - donated aliases, or XLA's reported peak if that is larger.
  """
  total = int(
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    + stats.temp_size_in_bytes
    - stats.alias_size_in_bytes
  )
  return max(total, int(getattr(stats, "peak_memory_in_bytes", 0) or 0))


def train_step_memory(
  steps: StepFunctions,
  params: Any,
  rest: Any,
  opt_state: Any,
  image_shape: tuple[int, ...],
  batch_size: int,
  *,
  num_classes: int | None = None,
  soft_labels: bool = False,
) -> dict[str, int]:
  """XLA memory analysis of the compiled train step at ``batch_size``.

  Compiles (does not run) ``steps.train`` on abstract inputs of shape
  ``[batch_size, *image_shape]``; PruneTrain's dynamic mini-batch (§4.3) uses ``"total"`` to
  pick the largest batch that fits the memory freed by a reconfiguration.

  Args:
    steps: the jitted step functions.
    params: current params (only shapes are used).
    rest: the model's other variables (shapes).
    opt_state: the optimizer state (shapes).
    image_shape: one example's shape, e.g. ``(32, 32, 3)``.
    batch_size: batch size to analyse.
    num_classes: required if ``soft_labels``.
    soft_labels: analyse with ``[B, C]`` float labels instead of int ``[B]``.

  Returns:
    dict with ``argument``, ``output``, ``temp``, ``alias``, ``generated_code`` and
    ``total`` (:func:`memory_bytes`) in bytes.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if soft_labels and num_classes is None:
    raise ValueError("num_classes is required when soft_labels=True")
  images = jax.ShapeDtypeStruct((batch_size, *image_shape), jnp.float32)
  labels = (
    jax.ShapeDtypeStruct((batch_size, num_classes), jnp.float32)
    if soft_labels
    else jax.ShapeDtypeStruct((batch_size,), jnp.int32)
  )
  state = _abstract(TrainState(params, rest, opt_state, Metrics.zeros()))
  stats = steps.train.lower(state, images, labels).compile().memory_analysis()
  return {
    "argument": int(stats.argument_size_in_bytes),
    "output": int(stats.output_size_in_bytes),
    "temp": int(stats.temp_size_in_bytes),
    "alias": int(stats.alias_size_in_bytes),
    "generated_code": int(stats.generated_code_size_in_bytes),
    "total": memory_bytes(stats),
  }

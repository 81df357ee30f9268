"""Checks of a train step's inputs and outputs that name what went wrong: finiteness of the loss
and gradients (one decision per step), non-finite images, class ids outside the model's
outputs, labels whose shape or dtype do not fit the batch, unnormalised integer images, a batch
whose channel count is not the model's, and the copies that keep donated buffers from deleting
arrays the caller still holds."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
  "BatchFlags",
  "NonFiniteError",
  "batch_flags",
  "copy_arrays",
  "input_channel_error",
  "integer_images",
  "label_error",
  "tree_all_finite",
]


class NonFiniteError(FloatingPointError):
  """Training stopped after too many consecutive non-finite train steps.

  The limit is ``max_nonfinite_steps`` of :class:`~jaxprune.train.Trainer`.

  Attributes:
    epoch: the 1-based epoch of the first step of that run.
    step: its 1-based step within that epoch (in the loader's order).
    limit: the ``max_nonfinite_steps`` that was reached.
  """

  def __init__(self, message: str, *, epoch: int, step: int, limit: int):
    super().__init__(message)
    self.epoch, self.step, self.limit = epoch, step, limit


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
  # Host metadata only: a device array's shape and dtype need no transfer or sync.
  if not hasattr(x, "dtype"):
    x = np.asarray(x)
  return tuple(np.shape(x)), np.dtype(x.dtype)


def label_error(images: Any, labels: Any) -> str | None:
  """A message naming ``labels`` when they do not fit the batch, else ``None``.

  Labels are integer class ids ``[B]`` or floating soft labels ``[B, C]``, one row per image.
  Checked on the host before the step, from shapes and dtypes alone: the step would fail on a
  short batch of labels with a broadcasting error deep in the loss, and would take float
  class ids with only a deprecation warning.
  """
  (ishape, _), (lshape, ldtype) = _shape_dtype(images), _shape_dtype(labels)
  if len(lshape) not in (1, 2):
    return (
      f"labels: expected shape [B] (integer class ids) or [B, C] (soft labels), got shape "
      f"{lshape} for images of shape {ishape}"
    )
  if ishape and lshape[0] != ishape[0]:
    return (
      f"labels: {lshape[0]} rows (shape {lshape}) for {ishape[0]} images (shape {ishape}); "
      "each image needs one label"
    )
  if len(lshape) == 1 and not np.issubdtype(ldtype, np.integer):
    return (
      f"labels: class ids [B] must have an integer dtype (e.g. int32), got {ldtype} (shape "
      f"{lshape}); soft labels are floats of shape [B, C]"
    )
  if len(lshape) == 2 and not np.issubdtype(ldtype, np.floating):
    return (
      f"labels: soft labels [B, C] must have a floating dtype (e.g. float32), got {ldtype} "
      f"(shape {lshape}); class ids are integers of shape [B]"
    )
  return None


def integer_images(images: Any) -> np.dtype | None:
  """The images' dtype if it is an integer one (raw pixels, e.g. uint8 0-255), else ``None``."""
  _, dtype = _shape_dtype(images)
  return dtype if np.issubdtype(dtype, np.integer) else None


def _floating(tree: Any) -> list[jax.Array]:
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]


def tree_all_finite(*trees: Any) -> jax.Array:
  """Whether every floating entry of ``trees`` is finite: one boolean for the whole step.

  A finite loss does not imply finite gradients: one NaN pixel can give a NaN gradient while
  the logits stay finite (a ReLU or a select between the NaN and the loss), so the loss alone
  is no guard.
  """
  leaves = _floating(trees)
  if not leaves:
    return jnp.bool_(True)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


class BatchFlags(NamedTuple):
  """Why a batch may give a non-finite step (booleans, traced)."""

  inputs_nonfinite: jax.Array  # NaN / Inf in the images (or in soft labels)
  labels_out_of_range: jax.Array  # an integer class id outside [0, classes)


def batch_flags(images: jax.Array, labels: jax.Array, num_classes: int) -> BatchFlags:
  """:class:`BatchFlags` of one batch for a model with ``num_classes`` outputs."""
  labels = jnp.asarray(labels)
  inputs_nonfinite = ~tree_all_finite(images, labels)
  if labels.ndim == 1 and jnp.issubdtype(labels.dtype, jnp.integer):
    out_of_range = jnp.any((labels < 0) | (labels >= num_classes))
  else:
    out_of_range = jnp.bool_(False)
  return BatchFlags(inputs_nonfinite, out_of_range)


def copy_arrays(tree: Any) -> Any:
  """``tree`` with every ``jax.Array`` leaf copied into a buffer of its own.

  The train step donates its state: without a copy, an array the caller still holds (an
  ``nnx.clone`` of the model, which shares its arrays, or a state captured before training)
  would be deleted by the step.
  """
  return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def _fits(graphdef: nnx.GraphDef, params: Any, rest: Any, shape, dtype) -> bool:
  x = jax.ShapeDtypeStruct(tuple(shape), dtype)
  try:
    jax.eval_shape(lambda p, r, x: nnx.merge(graphdef, p, r)(x), params, rest, x)
  except Exception:  # noqa: BLE001 (any failure: this batch shape does not fit)
    return False
  return True


def input_channel_error(graphdef: nnx.GraphDef, params: Any, rest: Any, images: Any) -> str | None:
  """A message if ``images`` do not fit the model only because of their channel count.

  Called after the step failed on ``images``: the model is traced (``jax.eval_shape``, no
  computation) with the batch's channel axis (the last, NHWC) replaced by the input channels
  of each of the model's convolutions (HWIO kernels, axis 2), until one fits.

  Returns:
    ``None`` when the batch fits as it is or no channel count makes it fit (the failure is
    something else); else a message naming both channel counts.
  """
  shape, dtype = np.shape(images), jnp.result_type(images)
  if len(shape) < 2 or _fits(graphdef, params, rest, shape, dtype):
    return None
  candidates = dict.fromkeys(
    int(np.shape(x)[2]) for x in jax.tree.leaves(params) if np.ndim(x) == 4
  )
  for channels in candidates:
    if channels != shape[-1] and _fits(graphdef, params, rest, (*shape[:-1], channels), dtype):
      return (
        f"images: the batch has {shape[-1]} channels (shape {tuple(shape)}, NHWC) but the "
        f"model takes {channels} input channel{'s' if channels != 1 else ''}: build the model "
        f"for the data (jaxprune.models.create(name, ..., in_channels={shape[-1]})) or give it "
        f"{channels}-channel images"
      )
  return None

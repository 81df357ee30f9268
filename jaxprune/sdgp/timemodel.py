"""The parts of SDGP's time model (§IV-C, Fig. 9/10), timed on the device at hand.

Of a conv layer's training work, the forward, the input (data) gradient dX and the weight
gradient dW each cost about the same; SDGP accelerates only dX, by m/n with N:M sparse
hardware. :func:`conv_layers` records every conv call of one forward pass with its real shapes,
and :func:`layer_jobs` gives each part of one layer as its own jitted function (``jax.vjp`` of
``lax.conv_general_dilated`` w.r.t. one argument; XLA drops the unused forward), to be timed with
:func:`jaxprune.timing.interleaved_times`. The stem's dX is not part of training (its input is
the image) and is left out, as in the paper's framework.

Example:
  >>> records = conv_layers(model, (32, 32, 32, 3))
  >>> jobs = {(i, part): job for i, r in enumerate(records)
  ...         for part, job in layer_jobs(r, jax.random.key(i)).items()}
  >>> seconds = timing.interleaved_times(jobs, rounds=5)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["conv_layers", "layer_jobs"]


class _ConvRecorder:
  """Stands in for ``lax.conv_general_dilated`` inside an ``nnx.Conv`` to record its call."""

  def __init__(self, name: str, records: list[dict[str, Any]]):
    self.name, self.records = name, records

  def __call__(self, lhs, rhs, window_strides, padding, **kwargs):
    kwargs.pop("out_sharding", None)
    kwargs.pop("preferred_element_type", None)
    self.records.append(
      {
        "name": self.name,
        "lhs": lhs.shape,
        "rhs": rhs.shape,
        "strides": tuple(window_strides),
        "padding": padding,
        "kwargs": kwargs,
      }
    )
    return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, **kwargs)


def conv_layers(model: nnx.Module, image_shape: tuple[int, ...]) -> list[dict[str, Any]]:
  """Every conv call of one forward pass, in execution order, with its arguments."""
  records: list[dict[str, Any]] = []
  convs = [(p, c) for p, c in nnx.iter_modules(model) if isinstance(c, nnx.Conv)]
  originals = [c.conv_general_dilated for _, c in convs]
  for path, conv in convs:
    conv.conv_general_dilated = _ConvRecorder("/".join(map(str, path)), records)
  try:
    model.eval()
    jax.eval_shape(lambda x: model(x), jax.ShapeDtypeStruct(image_shape, jnp.float32))
  finally:
    for (_, conv), original in zip(convs, originals):
      conv.conv_general_dilated = original
    model.train()
  return records


def layer_jobs(layer: dict[str, Any], key: jax.Array) -> dict[str, tuple[Callable, tuple]]:
  """The forward, dX and dW convs of one layer, each jitted on its own."""

  def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, layer["strides"], layer["padding"], **layer["kwargs"])

  kx, kw, kg = jax.random.split(key, 3)
  x = jax.random.normal(kx, layer["lhs"])
  w = jax.random.normal(kw, layer["rhs"])
  g = jax.random.normal(kg, jax.eval_shape(conv, x, w).shape)
  input_grad = jax.jit(lambda x, w, g: jax.vjp(lambda x_: conv(x_, w), x)[1](g)[0])
  weight_grad = jax.jit(lambda x, w, g: jax.vjp(lambda w_: conv(x, w_), w)[1](g)[0])
  jobs = {"forward": (jax.jit(conv), (x, w)), "weight_grad": (weight_grad, (x, w, g))}
  if layer["lhs"][-1] > 3:  # the stem's input is the image: no dX in training
    jobs["input_grad"] = (input_grad, (x, w, g))
  return jobs

"""Re-estimating BatchNorm running statistics from training batches.

In train mode BatchNorm normalises with the batch's own statistics and keeps an exponential
moving average (momentum 0.9: about the last ten steps) for eval mode. When the weights move
fast, e.g. under a strong group-lasso penalty that shrinks whole channels every step, that
average lags behind what the current weights produce, and eval-mode accuracy says little
about the trained weights. :func:`recompute_batch_stats` replaces the running statistics with
the plain average of the per-batch statistics of the *current* weights over a few batches,
as SWA's ``bn_update`` does after weight averaging.

References:
  Izmailov et al., "Averaging Weights Leads to Wider Optima and Better Generalization",
  UAI 2018 (``bn_update``). https://arxiv.org/abs/1803.05407
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune.train._loaders import LoaderView

__all__ = ["batchnorm_layers", "epoch_batches", "recompute_batch_stats"]


def batchnorm_layers(model: nnx.Module) -> list[nnx.BatchNorm]:
  """Every ``nnx.BatchNorm`` of ``model``, in graph order.

  The data-parallel step averages their running statistics over devices.
  """
  return [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.BatchNorm)]


@functools.lru_cache(maxsize=8)
def _batch_stats_fn(graphdef: nnx.GraphDef):
  """Jitted ``(stats, rest, images) -> batch statistics``, one per model structure (so a
  re-estimation every epoch compiles once, until a reconfiguration changes the shapes)."""

  @jax.jit
  def batch_stats(stats, rest, images):
    module = nnx.merge(graphdef, stats, rest)
    module(images)
    return nnx.as_pure(nnx.state(module, nnx.BatchStat))

  return batch_stats


def _images(batch: Any) -> Any:
  """The images of a loader batch: ``(images, labels, ...)`` or the images alone."""
  return batch[0] if isinstance(batch, (tuple, list)) else batch


def epoch_batches(train_loader: Iterable[Any], epoch: int) -> Iterable[Any]:
  """The batches of epoch ``epoch`` (1-based) of ``train_loader``.

  Epochs count as the trainer's callbacks count them. ``train_loader.iter_epoch(epoch - 1)`` when it
  has one (a :class:`jaxprune.data.Loader`; the loader's own position is left alone, and the same
  epoch gives the same batches, so a resumed run re-estimates from the same images), otherwise a
  fresh ``iter(train_loader)`` (:meth:`~jaxprune.train.LoaderView.epoch_batches`).
  """
  return LoaderView.of(train_loader).epoch_batches(epoch - 1)


def recompute_batch_stats(
  model: nnx.Module, batches: Iterable[Any], num_batches: int | None = None
) -> int:
  """Sets every BatchNorm's running mean / variance to their average over ``batches``.

  Runs a copy of ``model`` in train mode on each batch and records, per BatchNorm, the
  batch mean and (biased, as BatchNorm normalises with it in training) batch variance of
  its input, computed with the current weights; the running statistics become the
  unweighted average over the batches (a cumulative average, not a moving one). Nothing
  else of ``model`` changes: parameters, random-stream counters and the train/eval mode
  stay as they were. Training never reads running statistics, so re-estimating them
  changes evaluation only.

  Args:
    model: an NNX model; updated in place.
    batches: an iterable of batches, each ``(images, labels, ...)`` or an image array
      (e.g. a :class:`jaxprune.data.Loader`, or ``loader.iter_epoch(epoch)``, which leaves
      the loader's position alone).
    num_batches: use at most this many batches; ``None`` uses all.

  Returns:
    The number of batches used (0 when the model has no BatchNorm: nothing is read).

  Raises:
    ValueError: ``num_batches`` not a positive int or ``None``; ``batches`` yields nothing.

  Example:
    >>> recompute_batch_stats(model, loader.iter_epoch(0), num_batches=10)  # doctest: +SKIP
    10

  References:
    Izmailov et al., UAI 2018 (SWA ``bn_update``).
  """
  if num_batches is not None and (
    isinstance(num_batches, bool)
    or not isinstance(num_batches, (int, np.integer))
    or num_batches < 1
  ):
    raise ValueError(f"num_batches must be a positive int or None, got {num_batches!r}")
  if not batchnorm_layers(model):
    return 0
  work = nnx.clone(model)
  work.train()
  # Momentum 0: after one call each running statistic *is* that batch's statistic.
  for bn in batchnorm_layers(work):
    bn.momentum = 0.0
  graphdef, stats, rest = nnx.split(work, nnx.BatchStat, ...)
  rest = nnx.as_pure(rest)

  batch_stats = _batch_stats_fn(graphdef)
  stats = nnx.as_pure(stats)
  total, count = None, 0
  for batch in itertools.islice(batches, num_batches):
    current = batch_stats(stats, rest, jnp.asarray(_images(batch)))
    total = current if total is None else jax.tree.map(jnp.add, total, current)
    count += 1
  if total is None:
    raise ValueError("batches: yielded no batches to estimate BatchNorm statistics from")
  average = jax.tree.map(lambda t: t / count, total)
  nnx.update(model, average)
  return count

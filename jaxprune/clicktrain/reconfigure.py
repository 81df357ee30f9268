"""ClickTrain's state through a PruneTrain reconfiguration (channel removal).

ClickTrain keys its per-layer state by the kernel's parameter path, in ``(Cin, Cout)``-shaped
(or HWIO-shaped) arrays that are not parameter-shaped trees, so PruneTrain's surgery cannot
find them by shape. This slicer, registered with
:func:`jaxprune.state_slicing.register_state_slicer` (the shared registry: ClickTrain does not
import PruneTrain), slices them with the kept input / output channels of their kernel and
drops the layers removed with their residual branch: the masks
(pattern, kernel), the finalization votes and Eq. 2 score sums follow their kernels, and the
aligned mode's filter group ids follow their filters (a filter keeps its group, so the masks
stay shared within each group; the groups may come out uneven). The pattern pool and its
competitive scores are per pattern, not per channel, and are kept. The wrapped optimizer's
state is sliced like any other optimizer state.

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170

  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxprune.clicktrain.state import ClickTrainLayerState, ClickTrainState
from jaxprune.state_slicing import ChannelSlices, register_state_slicer

__all__ = ["slice_state"]


def _slice_layer(path: str, layer: ClickTrainLayerState, slices: ChannelSlices):
  def cin_cout(array):  # (Cin, Cout, ...) arrays: votes, score sums, pattern ids, kernel masks
    return slices.take(array, path, in_axis=0, out_axis=1)

  return layer._replace(
    votes=cin_cout(layer.votes),
    kernel_score_sum=cin_cout(layer.kernel_score_sum),
    pattern_id=cin_cout(layer.pattern_id),
    kernel_keep=cin_cout(layer.kernel_keep),
    pattern_mask=slices.take(layer.pattern_mask, path, in_axis=2, out_axis=3),  # HWIO
    filter_group=_kept_filters(layer.filter_group, slices.kernel_index(path)[1]),
  )


def _kept_filters(ids, out_index):
  """The ``(Cout,)`` group ids of the kept filters (on the host, as the other slices)."""
  if ids is None or out_index is None:
    return ids
  return jnp.asarray(np.take(np.asarray(ids), out_index), jnp.int32)


def slice_state(state: ClickTrainState, slices: ChannelSlices) -> ClickTrainState:
  """``state`` for the reconfigured params.

  Every layer sliced with its kernel's kept channels, removed layers dropped, the inner optimizer
  state sliced.

  Args:
    state: a :class:`~jaxprune.clicktrain.ClickTrainState`.
    slices: the reconfiguration's :class:`~jaxprune.state_slicing.ChannelSlices`.

  Returns:
    The sliced state (stage, counters and pattern pools unchanged).
  """
  layers = {
    path: _slice_layer(path, layer, slices)
    for path, layer in state.layers.items()
    if not slices.removed(path)
  }
  return state._replace(layers=layers, inner_state=slices.slice_state(state.inner_state))


register_state_slicer(ClickTrainState, slice_state)

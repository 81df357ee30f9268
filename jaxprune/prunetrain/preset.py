"""PruneTrain as a :class:`jaxprune.methods.Method`: the registry's ``prunetrain``.

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

from typing import Any

from jaxprune.method_api import Method, Run, split_config
from jaxprune.prunetrain.callback import PruneTrainCallback
from jaxprune.prunetrain.optimizer import with_group_lasso
from jaxprune.prunetrain.penalised import PenalisedAxes

__all__ = ["method"]


def method(**config: Any) -> Method:
  """PruneTrain (channel group lasso + periodic reconfiguration, PruneTrain §4) as a method.

  ``make_tx(inner, run)`` is :func:`jaxprune.prunetrain.with_group_lasso` around ``inner``;
  ``callbacks(run)`` is one :class:`jaxprune.prunetrain.PruneTrainCallback` tracing images of
  ``run.image_shape``. Each key goes to whichever of the two takes it; the defaults are theirs
  (the paper's: penalty ratio 0.2, reconfiguration every 10 epochs, threshold 1e-4, dynamic
  mini-batch on).

  Args:
    **config: keywords of ``with_group_lasso`` (``penalty_ratio``, ``proximal``, ...) and of
      ``PruneTrainCallback`` (``every_epochs``, ``threshold``, ``dynamic_batch``, ...), except
      ``inner`` and ``image_shape``.

  Returns:
    A :class:`jaxprune.methods.Method` named ``"prunetrain"``.

  Raises:
    ValueError: a key neither takes (bad values fail in ``make_tx`` / ``callbacks``);
      ``callbacks(run)`` with no ``run.image_shape``.

  Example:
    >>> from jaxprune import prunetrain
    >>> m = prunetrain.method(penalty_ratio=0.2, every_epochs=10)
  """
  routed = split_config(
    config,
    {
      "optimizer": (with_group_lasso, ("inner",)),
      "callback": (PruneTrainCallback, ("image_shape",)),
    },
    owner="prunetrain",
  )

  # One layout shared by the optimizer and the callback: the callback binds it to the
  # trainer's model when fit starts, so the penalty's kernels and classifier are the graph's.
  penalised = routed["optimizer"].pop("penalised", None) or PenalisedAxes()
  routed["callback"].pop("penalised", None)

  def make_tx(inner, run: Run):
    del run
    return with_group_lasso(inner, penalised=penalised, **routed["optimizer"])

  def callbacks(run: Run):
    if run.image_shape is None:
      raise ValueError("run.image_shape: PruneTrain traces the model on one training image")
    return [
      PruneTrainCallback(image_shape=run.image_shape, penalised=penalised, **routed["callback"])
    ]

  return Method(name="prunetrain", make_tx=make_tx, callbacks=callbacks, config=dict(config))

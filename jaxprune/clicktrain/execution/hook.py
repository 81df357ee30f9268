"""The trainer hook that switches ClickTrain's pruned convs to sparse layers after the hard
prune (ClickTrain §5.2): :class:`SparseExecution`.

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from flax import nnx

from jaxprune.clicktrain.execution.conversion import ConversionReport, to_sparse_layers
from jaxprune.clicktrain.execution.options import SparseExecutionConfig, as_config
from jaxprune.clicktrain.readouts import filter_partition, find_state, masks, stage_name
from jaxprune.masking import count_refilled
from jaxprune.train import Callback, LoaderView, TrainerLike

__all__ = ["SparseExecution"]


class SparseExecution(Callback):
  """Trainer hook: switch the pruned convs to a sparse layer once the masks are final.

  At the first epoch end where ClickTrain's stage is ``"pruned"`` and the pruned weights are
  exactly zero (the epoch end at which the stage changes: the step entering it zeroes them;
  weights that are not zero there, e.g. re-filled by a transform chained after ClickTrain,
  would make the dense and the sparse model compute different functions), and on a resumed run
  when the fit starts, it runs
  :func:`~jaxprune.clicktrain.execution.conversion.to_sparse_layers` on the trainer's model
  with the masks from the optimizer state and installs it (one recompilation). Later epochs do
  nothing, unless the trainer's model was replaced (a PruneTrain reconfiguration rebuilds it
  dense): the new model is converted with its sliced masks.

  Args:
    config: a :class:`~jaxprune.clicktrain.execution.options.SparseExecutionConfig`; or
    **options: its fields (by default every layer is timed both ways once, at the conversion,
      then the whole model three ways). ``filter_groups="from_state"``: each layer's groups as
      the ClickTrain state holds them (:func:`~jaxprune.clicktrain.filter_partition`, read at
      every conversion, so a resumed or reconfigured run uses its own), what
      ``filter_grouping="clustered"`` needs. ``input_shape`` defaults to the training loader's
      batch size and ``dataset.image_shape`` (a ``jaxprune.data.Loader``), read each epoch.

  Raises:
    ValueError: an option the conversion would refuse, named, when the hook is built (not at
      the hard prune): e.g. ``filter_groups="from-state"``, ``threshold="measured"`` or
      ``1.5``, ``repeats=0``.

  Attributes:
    config: the checked options.
    choices: the per-layer decisions (a
      :class:`~jaxprune.clicktrain.execution.conversion.ConversionReport`), once converted.

  Example::

    trainer = train.Trainer(model, clicktrain.clicktrain(inner, ...),
                            callbacks=[SparseExecution()])
  """

  def __init__(self, config: SparseExecutionConfig | None = None, /, **options: Any):
    # Checked here, not at the hard prune hours later (ClickTrain §5.2 converts once).
    self.config = as_config(config, options)
    self.choices: ConversionReport | None = None
    self._loader_shape: tuple[int, ...] | None = None
    # The model last converted: a model rebuilt since (PruneTrain's reconfiguration) is
    # converted again, with the sliced masks.
    self._converted: nnx.Module | None = None

  def _input_shape(self) -> tuple[int, ...] | None:
    return self.config.input_shape or self._loader_shape

  def _convert(self, trainer: TrainerLike) -> None:
    model = trainer.model
    if model is self._converted:
      return
    state = find_state(trainer.opt_state)  # found once; the read-outs below take it as is
    if stage_name(state) != "pruned":
      return
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    weight_masks = masks(state, params)
    if count_refilled(weight_masks, params)[0]:
      return  # pruned weights re-filled: the sparse model would compute another function
    if self.config.measures() and self._input_shape() is None:
      raise ValueError(
        "input_shape: SparseExecution measures each layer by default and needs the input "
        "batch shape: pass input_shape=, train with a jaxprune.data.Loader, or set a threshold"
      )
    groups = self.config.filter_groups
    if isinstance(groups, str) and groups == "from_state":
      groups = filter_partition(state)
    config = dataclasses.replace(self.config, input_shape=self._input_shape(), filter_groups=groups)
    model, self.choices = to_sparse_layers(model, weight_masks, config)
    trainer.replace(model, trainer.opt_state)
    self._converted = model

  def on_fit_start(self, trainer: TrainerLike) -> None:
    if self.config.measures() and self._input_shape() is None:
      # A resumed run converts at its first epoch end, once the loader's shape is known (its
      # first epoch runs the masked dense convs: pass input_shape to switch at once).
      return
    self._convert(trainer)

  def on_train_epoch_end(self, trainer: TrainerLike, epoch: int, train_loader: Any) -> None:
    del trainer, epoch
    view = LoaderView.of(train_loader)
    shape, size = view.image_shape, view.batch_size
    if shape is not None and size:
      self._loader_shape = (size, *shape)

  def on_epoch_end(self, trainer: TrainerLike, epoch: int) -> Mapping[str, Any]:
    del epoch
    self._convert(trainer)
    # In every record: the layers that run sparse from the next epoch on (0 before the switch).
    running = trainer.model is self._converted and self.choices is not None
    return {"sparse_layers": sum(c.backend != "dense" for c in self.choices) if running else 0}

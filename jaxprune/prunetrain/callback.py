"""PruneTrain inside the trainer: periodic reconfiguration, dynamic mini-batch and cost accounting.

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprune import flops
from jaxprune.prunetrain.dynamic_batch import DynamicBatch
from jaxprune.prunetrain.graph import (
  DEFAULT_THRESHOLD,
  ChannelGraph,
  _as_input_dtype,
  channel_graph,
)
from jaxprune.prunetrain.group_lasso import GroupLassoRatioState
from jaxprune.prunetrain.penalised import PenalisedAxes
from jaxprune.prunetrain.surgery import (
  ReconfigureReport,
  _check_finite,
  _check_reconfigure_args,
  _param_count,
  reconfigure,
  refuse_linen,
)
from jaxprune.train import (
  Callback,
  TrainerLike,
  cross_entropy,
  epoch_batches,
  recompute_batch_stats,
)

__all__ = ["RECORD_KEYS", "PruneTrainCallback", "model_costs"]

# PruneTrain Fig. 11 models the all-reduce of 4 GPUs.
_PAPER_DEVICES = 4


def model_costs(
  model: nnx.Module, image_shape: Sequence[int], *, num_devices: int = 4, input_dtype: Any = None
) -> dict[str, float]:
  """Per-image and per-step costs of a model (PruneTrain §5 Tab. 1, Fig. 8, Fig. 11).

  Uses :mod:`jaxprune.flops` (one trace of the forward pass; no compilation).

  Args:
    model: an NNX model.
    image_shape: one image, e.g. ``(32, 32, 3)``.
    num_devices: devices of the ring all-reduce model.
    input_dtype: the input's dtype (default float32; ``jnp.int32`` for token ids).

  Returns:
    ``inference_flops`` and ``train_flops`` per image, ``bn_bytes`` (BatchNorm training
    traffic per image), ``allreduce_bytes`` (bytes each device sends per step, ring
    all-reduce of all gradients) and ``params``.
  """
  shape = (1, *tuple(image_shape))
  layers, traffic = flops.layer_flops_and_batchnorm_traffic(
    model, shape, input_dtype=_as_input_dtype(input_dtype)
  )
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  return {
    "inference_flops": float(flops.inference_flops(layers)),
    "train_flops": float(flops.training_flops_per_step(layers)),
    "bn_bytes": float(sum(t.training_bytes for t in traffic)),
    "allreduce_bytes": float(flops.allreduce_bytes(params, num_devices)),
    "params": float(_param_count(model)),
  }


class PruneTrainCallback(Callback):
  """Trainer hook: reconfigure every k epochs, grow the mini-batch, account the costs.

  For :class:`jaxprune.train.Trainer` (``callbacks=[PruneTrainCallback(...)]``).  At the end
  of every ``every_epochs``-th epoch it runs :func:`reconfigure` on the trainer's model and
  optimizer state and installs the result when channels were removed (§4.2; the paper
  reconfigures every 10 epochs on CIFAR, 5 on ImageNet).  With ``dynamic_batch`` it then
  grows the batch in steps of ``granularity`` while the compiled step's memory (XLA
  ``memory_analysis``) stays within what the dense step needed, and scales the LR by the same
  ratio (§4.3, :class:`~jaxprune.prunetrain.dynamic_batch.DynamicBatch`; the trainer applies
  both from the next epoch).  Its entries carry a ``pt_`` prefix (``pt_reconfigured``,
  ``pt_next_batch_size``, ...).

  Every epoch's record gets the costs of the model that trained it (``jaxprune.flops``),
  and every record holds the same keys (:data:`RECORD_KEYS`; ``None`` where one does not
  apply), so a JSON-lines log has no ragged columns. Names say what each counts: ``pt_epoch_*``
  this epoch (training FLOPs of the model and of the dense model, BatchNorm traffic, ring
  all-reduce bytes), ``*_total`` the run so far (the same sums, §5's Table 1 figures), and
  ``pt_train_flops_ratio`` / ``pt_allreduce_ratio`` the ratios of the totals; the model's
  ``pt_params`` and ``pt_inference_flops`` (per image). The reconfiguration entries
  (``pt_reconfigured``: ``True`` installed, ``False`` checked and not worth it, ``None`` not a
  reconfiguration epoch; ``pt_channels_removed``, ``pt_layers_removed``,
  ``pt_inference_flops_after``, ``pt_params_after``, ``pt_spec``, ``pt_next_batch_size``) are
  ``None`` where none was installed.

  Args:
    every_epochs: reconfiguration interval in epochs.
    threshold: dead-group threshold (absolute max|w|).
    image_shape: one training image, e.g. ``(32, 32, 3)`` (one example: ``(128,)`` token ids).
    input_dtype: the dtype of the model's input, for tracing its channel graph and costs:
      float32 (images) by default, ``jnp.int32`` for token ids. The dynamic mini-batch
      measures the step with float images, so an integer input needs ``dynamic_batch=False``.
    dynamic_batch: grow the batch after a reconfiguration.
    granularity: batch growth step (paper: 32).
    max_batch_size: cap on the batch size (e.g. the training-set size).
    num_devices: devices of the ring all-reduce cost model; None (the default) takes the
      trainer's data-parallel devices (``Trainer.num_devices``) when it runs on more than one,
      and the paper's 4 GPUs (Fig. 11) on one device, where a real run sends nothing.
    channel_multiple: passed to :func:`reconfigure` (round kept channel counts up).
    min_flops_saving: install a reconfiguration only when it cuts the inference FLOPs by at
      least this fraction (0 = whenever a channel died, as in the paper).  Each installed
      reconfiguration recompiles the step (and, with ``dynamic_batch``, compiles it again per
      memory probe), which on a CPU costs many training steps of ResNet-32 (measured in
      ``experiments/results/benchmarks/prunetrain_reconfigure_compile_cpu.md``): a few dead
      channels are not worth it.  Skipped dead channels stay in the
      model (zero or near zero) and go at the next reconfiguration that is worth installing.
    recompute_batchnorm: re-estimate the BatchNorm running statistics from this many
      training batches (those the epoch just trained on, with the current weights;
      :func:`jaxprune.train.recompute_batch_stats`) before each evaluation and after each
      installed reconfiguration; 0 = off.  The group lasso shrinks whole channels every
      step, so the running averages (momentum 0.9, about the last ten steps) can lag far
      behind what the current weights produce, and eval mode then scores the weights
      wrongly (measured on the quickstart in ``docs/design.md``, "PruneTrain").  Off by
      default because the paper evaluates with the running statistics as training leaves
      them (it does not say otherwise), and at its settings (ratio 0.2, hundreds of steps
      per epoch) the weights move little within the averaging horizon.  Training never
      reads running statistics, so the option changes what evaluation (and the returned
      model in eval mode) sees, not the trained weights.  The batches come from the
      loader's ``iter_epoch`` when it has one (its position is left alone), otherwise
      from a fresh ``iter`` over it.
    strict: refuse a model whose channel graph meets an operation it cannot follow (named);
      False prunes the groups it can follow and leaves the others whole.
    penalised: the :class:`~jaxprune.prunetrain.PenalisedAxes` that the trainer's
      ``with_group_lasso(..., penalised=...)`` reads; the callback binds it to the trainer's
      model when ``fit`` starts and again after every installed reconfiguration, so the group
      lasso's kernels and classifier are the traced graph's (:func:`jaxprune.prunetrain.method`
      passes one to both).

  The model may be any NNX model called as ``model(images)``: its channel groups are traced
  from its forward pass for ``image_shape`` (:func:`~jaxprune.prunetrain.channel_graph`). When
  :meth:`Trainer.fit` starts, a model with nothing to prune, with non-finite kernels, or (with
  ``strict``) with an operation the graph cannot follow is refused with a ``ValueError`` naming
  it, not epochs later; doing nothing instead would hide that the run is not PruneTrain. The
  training loader must have a ``batch_size`` (a ``ValueError`` otherwise).

  Attributes:
    reports: the :class:`ReconfigureReport` of every reconfiguration so far (installed or not).

  Example::

    callback = PruneTrainCallback(every_epochs=10, image_shape=(32, 32, 3))
    trainer = Trainer(model, with_group_lasso(train.sgd(schedule)), callbacks=[callback])
  """

  def __init__(
    self,
    *,
    every_epochs: int = 10,
    threshold: float = DEFAULT_THRESHOLD,
    image_shape: Sequence[int] = (32, 32, 3),
    input_dtype: Any = None,
    dynamic_batch: bool = True,
    granularity: int = 32,
    max_batch_size: Optional[int] = None,
    num_devices: Optional[int] = None,
    channel_multiple: int = 1,
    min_flops_saving: float = 0.0,
    recompute_batchnorm: int = 0,
    strict: bool = True,
    penalised: Optional[PenalisedAxes] = None,
  ):
    # checked here too, so a bad value fails when the callback is built, not epochs later
    _check_reconfigure_args(threshold, channel_multiple)
    if not 0.0 <= min_flops_saving < 1.0:
      raise ValueError(f"min_flops_saving must be in [0, 1), got {min_flops_saving!r}")
    if not isinstance(every_epochs, int) or every_epochs < 1:
      raise ValueError(f"every_epochs must be a positive int, got {every_epochs!r}")
    if num_devices is not None and (
      isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1
    ):
      raise ValueError(f"num_devices must be None or a positive int, got {num_devices!r}")
    if (
      isinstance(recompute_batchnorm, bool)
      or not isinstance(recompute_batchnorm, int)
      or recompute_batchnorm < 0
    ):
      raise ValueError(
        f"recompute_batchnorm must be a non-negative int, got {recompute_batchnorm!r}"
      )
    if penalised is not None and not isinstance(penalised, PenalisedAxes):
      raise ValueError(
        f"penalised must be a prunetrain.PenalisedAxes or None, got {type(penalised).__name__}"
      )
    self.input_dtype = _as_input_dtype(input_dtype)
    if dynamic_batch and not jnp.issubdtype(self.input_dtype, jnp.floating):
      raise ValueError(
        f"dynamic_batch: the dynamic mini-batch measures the train step's memory with float "
        f"images, and the model's input is {self.input_dtype}; pass dynamic_batch=False"
      )
    self.penalised = penalised
    self.recompute_batchnorm = recompute_batchnorm
    self.strict = bool(strict)
    self._train_batches = None  # the epoch's training batches, between the two hooks
    # FLOPs are counted here, not by reconfigure: the old model's costs are already known
    # and the new model's are traced once, for the report and the accounting together.
    self._reconfigure_model = functools.partial(
      reconfigure,
      threshold=threshold,
      count_flops=False,
      channel_multiple=channel_multiple,
      input_shape=(1, *tuple(image_shape)),
      input_dtype=self.input_dtype,
    )
    self._new_costs: Optional[dict[str, float]] = None
    self.every_epochs = every_epochs
    self.image_shape = tuple(image_shape)
    self.min_flops_saving = float(min_flops_saving)
    self.threshold = threshold
    self.dynamic_batch = dynamic_batch
    self.num_devices = num_devices
    self.batch_policy = (
      DynamicBatch(self.image_shape, granularity=granularity, max_batch_size=max_batch_size)
      if dynamic_batch
      else None
    )
    self.reports: list[ReconfigureReport] = []
    self._state: dict[str, Any] = {
      "batch_size": None,
      "last_step": 0,
      "costs": None,
      "dense_costs": None,
      "train_flops": 0.0,
      "dense_train_flops": 0.0,
      "images": 0,
      "bn_bytes": 0.0,
      "allreduce_bytes": 0.0,
      "dense_allreduce_bytes": 0.0,
    }

  def _devices(self, trainer: TrainerLike) -> int:
    """The devices of the all-reduce cost model (see ``num_devices``)."""
    if self.num_devices is not None:
      return self.num_devices
    running_on = int(getattr(trainer, "num_devices", 1))
    return running_on if running_on > 1 else _PAPER_DEVICES

  def _reconfigure(
    self, model: nnx.Module, opt_state: Any, num_devices: int
  ) -> tuple[nnx.Module, Any, Any]:
    """:func:`reconfigure` with the report's FLOPs filled in from :func:`model_costs`."""
    new_model, new_opt_state, report = self._reconfigure_model(model, opt_state)
    old = self._state["costs"]
    if old is None:  # called before any epoch was accounted
      old = model_costs(
        model, self.image_shape, num_devices=num_devices, input_dtype=self.input_dtype
      )
    new = old
    if report.changed:
      new = model_costs(
        new_model, self.image_shape, num_devices=num_devices, input_dtype=self.input_dtype
      )
    self._new_costs = new
    report = dataclasses.replace(
      report,
      flops_before=round(old["inference_flops"]),
      flops_after=round(new["inference_flops"]),
      train_flops_before=round(old["train_flops"]),
      train_flops_after=round(new["train_flops"]),
      input_shape=(1, *self.image_shape),
    )
    return new_model, new_opt_state, report

  def _worth(self, report: ReconfigureReport) -> bool:
    """Install ``report``'s model? Something died and the FLOP saving is big enough."""
    if not report.changed:
      return False
    if self.min_flops_saving == 0.0 or report.flops_ratio is None:
      return True
    return 1.0 - report.flops_ratio >= self.min_flops_saving

  # Trainer callback protocol (jaxprune.train.Callback) -----------------------------
  def on_fit_start(self, trainer: TrainerLike) -> None:
    graph = _check_reconfigurable(trainer.model, self.image_shape, self.strict, self.input_dtype)
    self._bind_penalised(trainer.model, graph)
    if trainer.step == 0:
      _warn_if_pretrained(trainer)
    # Before the first epoch trains, not at its end: the loader's batch size is known now.
    self._check_countable(trainer)

  def _bind_penalised(self, model: nnx.Module, graph: Any = None) -> None:
    if self.penalised is not None:
      # The first bind takes the fit start's graph, and with it the input dtype; later binds
      # (after a reconfiguration) trace with the dtype the penalised axes kept from it.
      self.penalised.bind(model, (1, *self.image_shape), graph=graph)

  def _check_countable(self, trainer: TrainerLike) -> None:
    """The epochs' images are counted from the loader's batch size: a loader without one is
    refused (``ValueError``)."""
    if self._state["batch_size"] is None and trainer.reference_batch_size is None:
      raise ValueError(
        "train_loader: PruneTrainCallback counts the images of each epoch (cost accounting, "
        "batch growth) from the loader's batch_size; the training loader has none (use a "
        "jaxprune.data.Loader, or give the loader a batch_size attribute)"
      )

  def state_dict(self) -> dict[str, Any]:
    budget = self.batch_policy.state_dict() if self.batch_policy else {"budget_bytes": None}
    return {**self._state, **budget}

  def load_state_dict(self, state: Any) -> None:
    state = dict(state)
    budget = state.pop("budget_bytes", None)
    if self.batch_policy is not None:
      self.batch_policy.load_state_dict({"budget_bytes": budget})
    self._state.update(state)

  def on_train_epoch_end(self, trainer: TrainerLike, epoch: int, train_loader: Any) -> None:
    if not self.recompute_batchnorm:
      return
    # The batches the epoch just trained on.
    self._train_batches = functools.partial(epoch_batches, train_loader, epoch)
    self._recompute_batchnorm(trainer)

  def _recompute_batchnorm(self, trainer: TrainerLike) -> None:
    model = trainer.model
    recompute_batch_stats(model, self._train_batches(), self.recompute_batchnorm)
    trainer.replace(model)

  def on_epoch_end(self, trainer: TrainerLike, epoch: int) -> dict[str, Any]:
    try:
      return self._epoch_end(trainer, epoch)
    finally:
      self._train_batches = None

  def _epoch_end(self, trainer: TrainerLike, epoch: int) -> dict[str, Any]:
    # Every key in every record (None where it does not apply): no ragged JSON-lines columns.
    record = self._account(trainer) | dict.fromkeys(_RECONFIGURE_KEYS)
    if epoch % self.every_epochs:
      return record
    if self.batch_policy is not None:
      self.batch_policy.measure_budget(trainer)  # the dense step's memory, measured once
    new_model, new_opt_state, report = self._reconfigure(
      trainer.model, trainer.opt_state, self._devices(trainer)
    )
    self.reports.append(report)
    if not self._worth(report):
      record["pt_reconfigured"] = False
      return record
    trainer.replace(new_model, new_opt_state)
    self._bind_penalised(new_model)  # before the next step is traced at the new widths
    if self._train_batches is not None:
      # A removed branch's constant BN(0) output no longer reaches the layers after it.
      self._recompute_batchnorm(trainer)
    costs = self._state["costs"] = self._new_costs
    record.update(
      {
        "pt_reconfigured": True,
        **{f"pt_{key}": value for key, value in _report_metrics(report).items()},
        "pt_inference_flops_after": costs["inference_flops"],
        "pt_params_after": costs["params"],
        "pt_spec": repr(new_model.spec) if hasattr(new_model, "spec") else None,
      }
    )
    if self.batch_policy is not None and trainer.batch_size:
      new_batch = self.batch_policy.grow(trainer)
      record["pt_next_batch_size"] = self._state["batch_size"] = new_batch
    return record

  def _account(self, trainer: TrainerLike) -> dict[str, Any]:
    """Adds the epoch just trained to the running cost totals; returns its record entries."""
    state = self._state
    if state["costs"] is None:
      state["costs"] = model_costs(
        trainer.model,
        self.image_shape,
        num_devices=self._devices(trainer),
        input_dtype=self.input_dtype,
      )
      state["dense_costs"] = dict(state["costs"])
    if state["batch_size"] is None:
      self._check_countable(trainer)
      state["batch_size"] = int(trainer.reference_batch_size)
    reference = int(trainer.reference_batch_size or state["batch_size"])
    costs, dense = state["costs"], state["dense_costs"]
    steps = trainer.step - state["last_step"]
    images = steps * state["batch_size"]
    state["last_step"] = trainer.step
    state["images"] += images
    state["train_flops"] += costs["train_flops"] * images
    state["dense_train_flops"] += dense["train_flops"] * images
    state["bn_bytes"] += costs["bn_bytes"] * images
    state["allreduce_bytes"] += costs["allreduce_bytes"] * steps
    state["dense_allreduce_bytes"] += dense["allreduce_bytes"] * images / reference
    return {
      "pt_params": costs["params"],
      "pt_inference_flops": costs["inference_flops"],
      "pt_epoch_train_flops": costs["train_flops"] * images,
      "pt_epoch_dense_train_flops": dense["train_flops"] * images,
      "pt_epoch_bn_bytes": costs["bn_bytes"] * images,
      "pt_epoch_allreduce_bytes": costs["allreduce_bytes"] * steps,
      "pt_train_flops_total": state["train_flops"],
      "pt_dense_train_flops_total": state["dense_train_flops"],
      "pt_bn_bytes_total": state["bn_bytes"],
      "pt_train_flops_ratio": state["train_flops"] / max(state["dense_train_flops"], 1.0),
      "pt_allreduce_ratio": state["allreduce_bytes"] / max(state["dense_allreduce_bytes"], 1.0),
    }


# The entries of an installed reconfiguration (and pt_reconfigured), None in other epochs.
_RECONFIGURE_KEYS = (
  "pt_reconfigured",
  "pt_channels_removed",
  "pt_layers_removed",
  "pt_inference_flops_after",
  "pt_params_after",
  "pt_spec",
  "pt_next_batch_size",
)
# Every key of every epoch record the callback adds (its accounting, then the above).
RECORD_KEYS = (
  "pt_params",
  "pt_inference_flops",
  "pt_epoch_train_flops",
  "pt_epoch_dense_train_flops",
  "pt_epoch_bn_bytes",
  "pt_epoch_allreduce_bytes",
  "pt_train_flops_total",
  "pt_dense_train_flops_total",
  "pt_bn_bytes_total",
  "pt_train_flops_ratio",
  "pt_allreduce_ratio",
  *_RECONFIGURE_KEYS,
)


def _check_reconfigurable(
  model: nnx.Module, image_shape: tuple, strict: bool, input_dtype: Any = None
) -> ChannelGraph:
  """At fit start: ``model``'s channel graph has something to prune, nothing it cannot follow
  (with ``strict``) and finite kernels.

  Returns:
    The graph it traced (the penalised axes are read off it too).

  Raises:
    ValueError: what stops the reconfiguration, named, instead of a failure (or a run that
      never removes a channel) epochs later.
  """
  refuse_linen(model)  # before the first epoch trains, not at the first reconfiguration
  graph = channel_graph(model, (1, *image_shape), input_dtype=input_dtype)
  _check_finite(graph)
  if not any(g.kernels and not g.blocked for g in graph.groups):  # width 1: already cut down
    raise ValueError(
      f"model: PruneTrainCallback finds no channel group of the trainer's {type(model).__name__} "
      f"that a reconfiguration could remove ({graph.summary()}). Train it without the callback "
      "(prunetrain.with_group_lasso alone still regularizes)"
    )
  unfollowed = graph.unfollowed()
  if strict and unfollowed:
    named = "; ".join(f"{op} blocks {', '.join(groups)}" for op, groups in unfollowed.items())
    raise ValueError(
      f"model: the channel graph of the trainer's {type(model).__name__} cannot follow some "
      f"operations ({named}); PruneTrainCallback(strict=False) prunes only the "
      f"{len(graph.prunable)} other groups"
    )
  return graph


# PruneTrain §4.1 sets λ at initialisation, where CE₀ is about ln(classes); a first loss under
# this share of that says the model already fits, and λ from the ratio will be as much weaker.
_PRETRAINED_LOSS_SHARE = 0.5


def _warn_if_pretrained(trainer: TrainerLike) -> None:
  """Warns before the first step when λ will come from the penalty ratio of a model that
  already fits its data (fine-tuning): CE₀ is then small, and λ = r·CE₀ / ((1 − r)·GL₀) with it.
  """
  ratio_states = [
    s
    for s in jax.tree.leaves(
      trainer.opt_state, is_leaf=lambda s: isinstance(s, GroupLassoRatioState)
    )
    if isinstance(s, GroupLassoRatioState)
  ]
  loader = getattr(trainer, "train_loader", None)
  if not ratio_states or bool(ratio_states[0].initialized) or loader is None:
    return  # λ given by hand, already set (a resumed run), or no batch to look at
  batch = next(iter(epoch_batches(loader, 1)), None)
  if batch is None:
    return
  images, labels = jnp.asarray(batch[0]), jnp.asarray(batch[1])
  model = trainer.model
  model.eval()
  try:
    logits = model(images)
  finally:
    model.train()
  chance = math.log(logits.shape[-1])
  first_loss = float(cross_entropy(logits, labels))
  if math.isfinite(first_loss) and first_loss < _PRETRAINED_LOSS_SHARE * chance:
    warnings.warn(
      f"PruneTrainCallback: the group lasso's λ is computed from the first loss and the penalty "
      f"ratio (PruneTrain Eq. 3), and this model's loss on a training batch is already "
      f"{first_loss:.3f} against ln({logits.shape[-1]}) = {chance:.3f} for an untrained one: a "
      f"pretrained model gets a λ about {chance / max(first_loss, 1e-6):.0f}x weaker than the "
      "paper's from-scratch ratio means. For fine-tuning set λ yourself "
      "(prunetrain.add_group_lasso(coefficient)) or a larger penalty_ratio",
      UserWarning,
      stacklevel=3,
    )


def _report_metrics(report: ReconfigureReport) -> dict[str, Any]:
  """Record entries of an installed reconfiguration (``pt_``-prefixed later)."""
  return {
    "channels_removed": sum(report.channels_removed.values()),
    "layers_removed": len(report.removed_layers),
  }

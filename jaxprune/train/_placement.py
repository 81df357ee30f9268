"""The trainer's model, its trained arrays and its step: one part of
:class:`~jaxprune.train.Trainer`, held in its ``_placement`` field.

:class:`Placement` is the only writer of the trained state (``params``, ``rest``,
``opt_state``) and of the compiled step: the epoch loop runs the step through
:meth:`Placement.run_step`, batch growth edits the optimizer state through
:attr:`Placement.lr_scale` and :meth:`Placement.set_step_increment`, and a resume installs
what it read through :meth:`Placement.set_model`. With a mesh it places params and optimizer
state on every device and turns the gradient reduction sparse once the optimizer state holds
final masks (:mod:`jaxprune.train.data_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from jaxprune import distributed, masking
from jaxprune.train import _checks, data_parallel, optim
from jaxprune.train.compiled import step_functions, step_settings
from jaxprune.train.step import Metrics, PerExampleLoss, ReductionIndices, TrainState, split_model

__all__ = ["Placement"]


class Placement:
  """The model, its split state and the jitted (or data-parallel) step for its structure.

  Args:
    model: the NNX model; its variables are the trainer's until the first step.
    opt_state: the optimizer state of ``tx`` for the model's params.
    tx, loss_fn, flip_tta, donate, skip_nonfinite, mesh, sync_batchnorm: the trainer's
      settings of the step (see :class:`~jaxprune.train.Trainer`; ``mesh`` resolved).

  Attributes:
    params, rest, opt_state: the trained state (params, the model's other variables, the raw
      Optax state), written by this part only; the step donates them.
    steps: the jitted train / eval functions for the current structure.
    eval_graphdef: the model's graph definition in eval mode (for the input checks).
  """

  def __init__(
    self,
    model: nnx.Module,
    opt_state: Any,
    *,
    tx: optax.GradientTransformationExtraArgs,
    loss_fn: PerExampleLoss,
    flip_tta: bool,
    donate: bool,
    skip_nonfinite: bool,
    mesh: Any,
    sync_batchnorm: bool,
  ):
    self.tx, self.loss_fn, self.flip_tta = tx, loss_fn, flip_tta
    self.donate, self.skip_nonfinite = donate, skip_nonfinite
    self.mesh, self.sync_batchnorm = mesh, sync_batchnorm
    self.set_model(model, opt_state)

  def set_model(self, model: nnx.Module, opt_state: Any, indices: Any = None) -> None:
    """Installs ``model`` and ``opt_state`` with a step for their structure.

    ``indices``: the data-parallel reduction's kept entries, ``None`` dense.
    """
    self._model = model
    _, eval_gd, params, rest = split_model(model)
    self.params, self.rest, self.opt_state = params, rest, opt_state
    self.eval_graphdef = eval_gd
    self._model_synced = True
    # The arrays came from outside (the model, its clones, the caller's optimizer state, or
    # an optimizer state that aliases the params): copied before the first donating step.
    self._shared = ("params", "rest", "opt_state")
    # A new structure (PruneTrain's reconfiguration) or new masks: a new step, compiled at
    # its first call, and on a mesh the (new) states replicated on every device.
    self.steps = step_functions(
      step_settings(
        model,
        self.tx,
        self.loss_fn,
        mesh=self.mesh,
        sync_batchnorm=self.sync_batchnorm,
        flip_tta=self.flip_tta,
        donate=self.donate,
        skip_nonfinite=self.skip_nonfinite,
        indices=indices,
      )
    )
    if self.mesh is not None:
      self.replicate()

  def rebuild_step(self) -> None:
    """A step for the current settings; the trained state stays.

    For when ``loss_fn``, ``flip_tta``, ``donate``, ``skip_nonfinite`` were changed: the trained
    state stays, the step is traced anew.
    """
    self.set_model(self.model, self.opt_state, self.reduction_indices)

  def replicate(self) -> None:
    """Places params, rest and optimizer state on every device of the mesh.

    Host-side edits between epochs, e.g. an LR scale, may have left some leaves on one device.
    """
    self.params, self.rest, self.opt_state = self.steps.replicate(
      (self.params, self.rest, self.opt_state)
    )

  def sync_reduction(self) -> None:
    """Data parallelism: reduce only the kept gradient entries once masks are final.

    Once the optimizer state holds final masks (ClickTrain §5.3); index arrays built once per set of
    masks, the step rebuilt (and recompiled) only when they change.
    """
    masks = masking.find_masks(self.opt_state, self.params)
    indices = distributed.mask_indices(masks) if masks is not None else None
    if ReductionIndices(indices) != self.steps.settings.indices:
      self.set_model(self.model, self.opt_state, indices)

  @property
  def num_devices(self) -> int:
    """Devices the global batch is split over (1 without a mesh)."""
    return 1 if self.mesh is None else int(self.mesh.shape[data_parallel.BATCH_AXIS])

  @property
  def reduction_indices(self) -> Any:
    """The index arrays of the data-parallel gradient reduction.

    ``None``: dense, or no mesh.
    """
    return self.steps.settings.indices.tree

  @property
  def model(self) -> nnx.Module:
    """The live model (its variables are synced from the trained state on access)."""
    if not self._model_synced:
      nnx.update(self._model, self.params, self.rest)
      self._model_synced = True
      # The model now holds the trainer's arrays: a clone of it would share them.
      self._shared = tuple(dict.fromkeys((*self._shared, "params", "rest")))
    return self._model

  @property
  def module(self) -> nnx.Module:
    """The model object without a sync (its variables may lag the trained state).

    For its class, width spec and shapes, which a sync would not change, without the copy a sync
    costs the next donating step.
    """
    return self._model

  def mark_stale(self) -> None:
    """The trained state moved past the model's variables: the next :attr:`model` syncs."""
    self._model_synced = False

  def _own_donated_state(self) -> None:
    """Copies the state the train step is about to donate where someone else may hold it.

    With ``donate=True`` the step deletes its input buffers. The model the trainer was given
    and every ``nnx.clone`` of it (or of :attr:`model` after a sync) share their arrays with
    the trainer's state, so the first step after such a hand-over copies that state (one
    copy of params and BatchNorm statistics, plus the optimizer state when it came from
    outside) and points the model at the copies: the clones keep arrays of their own, and
    donation goes on freeing the step's memory as before.
    """
    if not self._shared or not self.donate:
      return
    for name in self._shared:
      setattr(self, name, _checks.copy_arrays(getattr(self, name)))
    self._shared = ()
    if self._model_synced:
      nnx.update(self._model, self.params, self.rest)

  def run_step(self, step: Callable[..., Any], metrics: Metrics, *batch: Any) -> Metrics:
    """Runs a train step on the trained state and returns the new metrics.

    Runs ``step(state, *batch)`` on the trained state (a copy first where it is shared, see
    :meth:`_own_donated_state`) and ``metrics``, keeps the new state and returns the new metrics.
    The model lags it until the next :attr:`model`.
    """
    self._own_donated_state()
    state = TrainState(self.params, self.rest, self.opt_state, metrics)
    self.params, self.rest, self.opt_state, metrics = step(state, *batch)
    self._model_synced = False
    return metrics

  @property
  def lr_scale(self) -> float | None:
    """Multiplier on the LR of every ``scale_by_lr`` in the optimizer (``None`` if none)."""
    return optim.get_lr_scale(self.opt_state)

  @lr_scale.setter
  def lr_scale(self, value: float) -> None:
    self.opt_state = optim.set_lr_scale(self.opt_state, value)

  @property
  def lr(self) -> float | None:
    """LR applied by the last step (``None`` if the optimizer does not expose it)."""
    return optim.get_lr(self.opt_state)

  def set_step_increment(self, increment: float) -> None:
    """Schedules advance by ``increment`` per step (:func:`jaxprune.train.set_step_increment`)."""
    self.opt_state = optim.set_step_increment(self.opt_state, increment)

  def replace(self, model: nnx.Module | None = None, opt_state: Any | None = None) -> None:
    """:meth:`Trainer.replace <jaxprune.train.Trainer.replace>`.

    A new model and/or optimizer state, checked against ``tx.init`` of the model's params.
    """
    model = self.model if model is None else model
    opt_state = self.opt_state if opt_state is None else opt_state
    # Leaves compared by path and shape, not tree structure: a state may carry static marks
    # that tx.init does not (ClickTrain's specialize_pruned), with the same arrays.
    expected = jax.tree_util.tree_flatten_with_path(
      jax.eval_shape(self.tx.init, nnx.as_pure(nnx.state(model, nnx.Param)))
    )[0]
    got = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    mismatch = first_mismatch(expected, got)
    if mismatch is not None:
      raise ValueError(
        f"opt_state: structure or shapes do not match tx.init(model params): {mismatch}"
      )
    self.set_model(model, opt_state)


def first_mismatch(expected: list[tuple[Any, Any]], got: list[tuple[Any, Any]]) -> str | None:
  """The first leaf where two flattened states differ, in words (``None``: they match).

  Args:
    expected: ``(key path, leaf)`` pairs of ``tx.init``'s state (leaves with a ``shape``).
    got: ``(key path, leaf)`` pairs of the given state.

  Returns:
    ``None`` when every path and shape agree; otherwise a sentence naming the first leaf that
    differs (by path) with its expected and given shape, or the leaf that one side lacks.
  """
  for (e_path, e_leaf), (g_path, g_leaf) in zip(expected, got):
    e_key, g_key = jax.tree_util.keystr(e_path), jax.tree_util.keystr(g_path)
    if e_key != g_key:
      return f"leaf {e_key} (shape {tuple(e_leaf.shape)}) expected where the state has {g_key}"
    if tuple(e_leaf.shape) != tuple(np.shape(g_leaf)):
      return f"leaf {e_key}: expected shape {tuple(e_leaf.shape)}, got {tuple(np.shape(g_leaf))}"
  if len(expected) > len(got):
    path, leaf = expected[len(got)]
    return f"leaf {jax.tree_util.keystr(path)} (shape {tuple(leaf.shape)}) missing from the state"
  if len(got) > len(expected):
    path, leaf = got[len(expected)]
    return f"leaf {jax.tree_util.keystr(path)} (shape {tuple(np.shape(leaf))}) not in tx.init's"
  return None

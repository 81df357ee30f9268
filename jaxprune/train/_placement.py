"""Where the trainer's state lives: the split model, its jitted (or data-parallel) step, and
the placement of params and optimizer state on the mesh, with the gradient reduction turned
sparse once the optimizer state holds final masks (:mod:`jaxprune.train.data_parallel`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxprune import distributed, masking
from jaxprune.train import _checks, data_parallel
from jaxprune.train.step import StepFunctions, split_model, step_functions

__all__ = ["Placement"]


class Placement:
  """:class:`~jaxprune.train.Trainer`'s model, state and step (a mixin of it: the attributes
  ``tx``, ``loss_fn``, ``flip_tta``, ``donate``, ``skip_nonfinite``, ``mesh`` and
  ``sync_batchnorm`` are the trainer's)."""

  def _set_model(self, model: nnx.Module, opt_state: Any, indices: Any = None) -> None:
    self._model = model
    train_gd, eval_gd, params, rest = split_model(model)
    self.params, self.rest, self.opt_state = params, rest, opt_state
    self._eval_graphdef = eval_gd
    self._model_synced = True
    # The arrays came from outside (the model, its clones, the caller's optimizer state, or
    # an optimizer state that aliases the params): copied before the first donating step.
    self._shared = ("params", "rest", "opt_state")
    if self.mesh is None:
      self._steps = step_functions(
        train_gd,
        eval_gd,
        self.tx,
        self.loss_fn,
        flip_tta=self.flip_tta,
        donate=self.donate,
        skip_nonfinite=self.skip_nonfinite,
      )
      return
    # A new structure (PruneTrain's reconfiguration) or new masks: a new step, compiled at
    # its first call, and the (new) states replicated on every device.
    self._steps = data_parallel.step_functions(
      model,
      self.tx,
      self.loss_fn,
      self.mesh,
      sync_batchnorm=self.sync_batchnorm,
      flip_tta=self.flip_tta,
      donate=self.donate,
      indices=indices,
      skip_nonfinite=self.skip_nonfinite,
    )
    self._replicate()

  def _replicate(self) -> None:
    """Places params, rest and optimizer state on every device of the mesh (host-side edits
    between epochs, e.g. an LR scale, may have left some leaves on one device)."""
    self.params, self.rest, self.opt_state = self._steps.replicate(
      (self.params, self.rest, self.opt_state)
    )

  def _sync_reduction(self) -> None:
    """Data parallelism: reduce only the kept gradient entries once the optimizer state
    holds final masks (ClickTrain §5.3); index arrays built once per set of masks, the step
    rebuilt (and recompiled) only when they change."""
    masks = masking.find_masks(self.opt_state, self.params)
    indices = distributed.mask_indices(masks) if masks is not None else None
    if data_parallel.indices_digest(indices) != self._steps.indices_digest:
      self._set_model(self.model, self.opt_state, indices)

  @property
  def num_devices(self) -> int:
    """Devices the global batch is split over (1 without a mesh)."""
    return 1 if self.mesh is None else int(self.mesh.shape[data_parallel.BATCH_AXIS])

  @property
  def reduction_indices(self) -> Any:
    """The index arrays of the data-parallel gradient reduction (``None``: dense, or no
    mesh)."""
    return getattr(self._steps, "indices", None)

  @property
  def model(self) -> nnx.Module:
    """The live model (its variables are synced from the trained state on access)."""
    if not self._model_synced:
      nnx.update(self._model, self.params, self.rest)
      self._model_synced = True
      # The model now holds the trainer's arrays: a clone of it would share them.
      self._shared = tuple(dict.fromkeys((*self._shared, "params", "rest")))
    return self._model

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

  @property
  def steps(self) -> StepFunctions:
    """The jitted train / eval functions for the current model structure."""
    return self._steps

  def replace(self, model: nnx.Module | None = None, opt_state: Any | None = None) -> None:
    """Install a new model and/or optimizer state (e.g. after PruneTrain reconfiguration).

    A model with new shapes gets newly jitted steps. If only ``model`` is given the
    optimizer state must still match its params (same structure and shapes).
    """
    model = self.model if model is None else model
    opt_state = self.opt_state if opt_state is None else opt_state
    expected, expected_def = jax.tree.flatten(
      jax.eval_shape(self.tx.init, nnx.as_pure(nnx.state(model, nnx.Param)))
    )
    got, got_def = jax.tree.flatten(opt_state)
    if expected_def != got_def or [e.shape for e in expected] != [np.shape(g) for g in got]:
      raise ValueError("opt_state: structure or shapes do not match tx.init(model params)")
    self._set_model(model, opt_state)

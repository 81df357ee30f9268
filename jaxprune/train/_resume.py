"""Checkpoint and resume wiring of :class:`~jaxprune.train.Trainer`: one part of it, held in
its ``_checkpoints`` field.

:class:`Checkpoints` owns the store: it claims ``checkpoint_dir`` for one run, writes what
the trainer hands it (with the run config and the starting model's structure), and on a
resume checks a checkpoint against this run, reads it into a model rebuilt to its width spec
and falls back past damaged ones. It writes only its own fields; the trainer installs what
was read into its other parts (the ``install`` of :meth:`Checkpoints.restore`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune import models
from jaxprune.paths import flatten_with_paths
from jaxprune.state_slicing import SurgeryPlan, applied_plans, apply_plan
from jaxprune.train._spec_json import decode_spec, encode_spec
from jaxprune.train.checkpoint import CheckpointStore, DamagedCheckpointError
from jaxprune.train.step import split_model

__all__ = ["Checkpoints", "model_spec", "model_structure"]


def model_spec(model: nnx.Module) -> Any:
  """JSON form of ``model.spec`` (``None`` if the model has none or it is not encodable)."""
  spec = getattr(model, "spec", None)
  if spec is None:
    return None
  try:
    return json.loads(json.dumps(encode_spec(spec)))
  except (TypeError, ValueError):
    return None


def model_structure(model: nnx.Module) -> dict[str, Any]:
  """What identifies the model a run starts from, as JSON.

  Its class, width spec (:func:`model_spec`) and parameter paths with their shapes.

  Stored in every checkpoint (``start_model``) and compared at a resume: two runs on one
  ``checkpoint_dir`` with different models must not adopt each other's checkpoints. It is
  the model the trainer was given, not the one it trains now: a run that reconfigured
  (PruneTrain) resumes from a fresh trainer built with the same starting model.
  """
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  return {
    "class": f"{type(model).__module__}.{type(model).__qualname__}",
    "spec": model_spec(model),
    "params": {
      "/".join(map(str, path)): list(np.shape(leaf)) for path, leaf in flatten_with_paths(params)
    },
  }


def _shape(shape: Any) -> Any:
  return "absent" if shape is None else tuple(shape)


def _structure_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """The differences of two :func:`model_structure` records, the first few named."""
  diff = [
    f"{key}: checkpoint {saved.get(key)!r} vs now {current.get(key)!r}"
    for key in ("class", "spec")
    if saved.get(key) != current.get(key)
  ]
  old, new = saved.get("params") or {}, current.get("params") or {}
  for path in sorted(set(old) | set(new)):
    if old.get(path) != new.get(path):
      diff.append(
        f"param {path}: checkpoint {_shape(old.get(path))} vs now {_shape(new.get(path))}"
      )
  return diff[:2] + [f"... {len(diff) - 2} more"] if len(diff) > 3 else diff


def _check_start_model(
  saved: Mapping[str, Any] | None, current: Mapping[str, Any], directory: Any
) -> None:
  """Refuse to resume a checkpoint of a run that started from another model (checkpoints
  written before the structure was stored are not checked)."""
  if saved is None or saved == current:
    return
  raise ValueError(
    f"model: the checkpoints of {directory} belong to a run of another model "
    f"({'; '.join(_structure_diff(saved, current))}): use another checkpoint_dir, or "
    "fit(resume=False, overwrite=True) to delete them"
  )


def _check_run_config(
  saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None, directory: Any
) -> None:
  """Refuse to resume a checkpoint written by a differently configured run."""
  if saved is None or current is None or saved == current:
    return
  keys = sorted(set(saved) | set(current))
  diff = [
    f"{k}: checkpoint {saved.get(k, '<absent>')!r} vs now {current.get(k, '<absent>')!r}"
    for k in keys
    if saved.get(k, "<absent>") != current.get(k, "<absent>")
  ]
  raise ValueError(
    f"run_config differs from the one stored in the checkpoints of {directory} "
    f"({'; '.join(diff)}): use another checkpoint_dir or delete it"
  )


class Checkpoints:
  """``checkpoint_dir``'s store and what ties its checkpoints to this run.

  Args:
    store: the checkpoint store (``None``: no ``checkpoint_dir``, nothing is saved).
    run_config: the JSON form of the trainer's ``run_config`` (``None``: not checked).
    model_builder: ``spec -> model`` for a checkpoint of another width spec (``None``:
      :func:`jaxprune.models.rebuild`).
  """

  def __init__(
    self,
    store: CheckpointStore | None,
    run_config: dict[str, Any] | None,
    model_builder: Callable[[Any], nnx.Module] | None,
  ):
    self.store, self.run_config, self.model_builder = store, run_config, model_builder
    self._start_structure: dict[str, Any] | None = None
    # True once checkpoint_dir holds only this run's checkpoints (restored from it, found it
    # empty, or cleared it with fit(overwrite=True)): only then may save write there.
    self._owns_store = False

  def start_model(self, model: nnx.Module) -> dict[str, Any]:
    """:func:`model_structure` of the model this run started from.

    Taken the first time a checkpoint is restored, the folder claimed or a checkpoint written
    (before any training, in ``fit``), so a reconfiguration later does not change it.
    """
    if self._start_structure is None:
      self._start_structure = model_structure(model)
    return self._start_structure

  def claim(self, model: nnx.Module, overwrite: bool) -> None:
    """Make ``checkpoint_dir`` this run's own before anything is written into it.

    Checkpoints are numbered by epoch and ``fit`` resumes the highest number, so a fresh run
    writing next to another run's checkpoints would leave the other run's later epochs as
    "latest" and a resume would silently continue the wrong run.
    """
    self.start_model(model)
    if self.store is None:
      return
    self.store.hold()
    if self._owns_store:
      return
    steps = self.store.all_steps()
    if steps and not overwrite:
      self.store.release()  # a run refused here does not keep the folder from the others
      raise ValueError(
        f"checkpoint_dir {self.store.directory} already holds the checkpoints {steps} of "
        "another run: resume it (fit(resume=True)), pass overwrite=True to delete them, or "
        "use another checkpoint_dir"
      )
    if steps:
      self.store.clear()
    self._owns_store = True

  def release(self) -> None:
    """Lets ``checkpoint_dir`` go for another trainer (:meth:`CheckpointStore.hold`)."""
    if self.store is not None:
      self.store.release()

  def save(
    self, model: nnx.Module, epoch: int, arrays: dict[str, Any], meta: dict[str, Any]
  ) -> None:
    """Writes checkpoint ``epoch`` of ``arrays`` and ``meta`` after claiming the folder.

    The run config and the starting model's structure are written too; a no-op without a store.
    """
    if self.store is None:
      return
    self.claim(model, overwrite=False)
    meta = {**meta, "run_config": self.run_config, "start_model": self.start_model(model)}
    self.store.save(epoch, arrays, meta)

  def _rebuild_model(self, model: nnx.Module, spec: Any) -> nnx.Module:
    if self.model_builder is not None:
      return self.model_builder(spec)
    if getattr(model, "num_classes", None) is None:
      raise ValueError(
        "checkpoint: model spec differs from the current model's and no "
        "model_builder was given to rebuild it"
      )
    # The checkpoint restores every variable, conversion state (e.g. SDGP keys) included.
    return models.rebuild(model, spec)

  def restore(
    self,
    model: nnx.Module,
    tx: Any,
    install: Callable[[nnx.Module, dict[str, Any], dict[str, Any]], None],
    step: int | None = None,
  ) -> bool:
    """Reads the latest (or given) checkpoint of a run and hands it to ``install``.

    The run is of ``model`` trained with ``tx``; the checkpoint goes to ``install(model, arrays,
    meta)``. Returns False if there is none.

    See :meth:`jaxprune.train.Trainer.restore_checkpoint` for the damaged-checkpoint
    fallback and the errors.
    """
    self.start_model(model)
    if self.store is None:
      return False
    # Before reading: a folder another live trainer writes into is not this run's to resume.
    self.store.hold()
    try:
      return self._restore_latest(model, tx, install, step)
    except Exception:
      if not self._owns_store:  # a run refused here does not keep the folder from the others
        self.store.release()
      raise

  def _restore_latest(self, model: nnx.Module, tx: Any, install: Callable, step: int | None):
    """:meth:`restore` once the folder is held."""
    if step is not None:
      self._restore_step(model, tx, install, step)
      return True
    damaged: list[DamagedCheckpointError] = []
    for candidate in reversed(self.store.all_steps()):
      try:
        self._restore_step(model, tx, install, candidate)
      except DamagedCheckpointError as e:
        damaged.append(e)
        continue
      for e in damaged:
        # Out of the numbered sequence, so the resumed run can write that epoch again.
        moved = self.store.set_aside(e.step)
        warnings.warn(f"{e}; moved to {moved} and resumed from checkpoint {candidate}")
      return True
    if damaged:
      newest, older = damaged[0], damaged[1:]
      raise DamagedCheckpointError(
        newest.step,
        newest.path,
        f"{newest.reason}; no intact checkpoint to fall back to" + "".join(f"; {e}" for e in older),
      )
    return False

  def _restore_step(self, model: nnx.Module, tx: Any, install: Callable, step: int) -> None:
    # Every read from the store happens before install changes the trainer's state, so a
    # damaged checkpoint leaves the trainer as it was.
    meta = self.store.restore_meta(step)
    _check_run_config(meta.get("run_config"), self.run_config, self.store.directory)
    _check_start_model(meta.get("start_model"), self.start_model(model), self.store.directory)
    plans = meta.get("surgery_plans") or []
    done = len(applied_plans(model))
    if len(plans) <= done and meta.get("model_spec") not in (None, model_spec(model)):
      model = self._rebuild_model(model, decode_spec(meta["model_spec"]))
    elif len(plans) > done:
      # A reconfigured model without a width spec: the full-size model the restarted process
      # built is cut as the run cut it (PruneTrain §4.2), then the weights are read into it.
      model = nnx.clone(model)
      for plan in plans[done:]:
        apply_plan(model, SurgeryPlan.from_json(plan))
    _, _, params, rest = split_model(model)
    template = {"params": params, "rest": rest, "opt_state": jax.eval_shape(tx.init, params)}
    template["opt_state"] = jax.tree.map(
      lambda s: jnp.zeros(s.shape, s.dtype), template["opt_state"]
    )
    arrays, meta = self.store.restore(step, template)
    self._owns_store = True  # the restored run goes on in its own folder
    install(model, arrays, meta)

"""Checkpoint and resume wiring of :class:`~jaxprune.train.Trainer`: what a checkpoint holds
beyond the arrays (epoch, loader position, batch sizes, callbacks' state, history, run
config), claiming ``checkpoint_dir`` for one run, and falling back past damaged checkpoints."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune import models
from jaxprune.paths import flatten_with_paths
from jaxprune.train import _loaders
from jaxprune.train._spec_json import decode_spec, encode_spec
from jaxprune.train.checkpoint import DamagedCheckpointError
from jaxprune.train.step import split_model

__all__ = ["Resume", "model_spec", "model_structure"]


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
  """What identifies the model a run starts from, as JSON: its class, width spec
  (:func:`model_spec`) and parameter paths with their shapes.

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


class Resume:
  """``save_checkpoint`` / ``restore_checkpoint`` (a mixin of :class:`~jaxprune.train.Trainer`:
  ``store``, ``run_config``, ``model_builder`` and the trained state are the trainer's)."""

  def _meta(self, loader: Any) -> dict[str, Any]:
    loader_state = _loaders.position(loader) if loader is not None else None
    return {
      "epoch": self.epoch,
      "step": self.step,
      "batch_size": _loaders.batch_size(loader),
      "reference_batch_size": self.reference_batch_size,
      # A batch change requested by an epoch-end hook applies at the next epoch.
      "pending_batch_size": (list(self._pending_batch_size) if self._pending_batch_size else None),
      "loader_state": loader_state,
      "model_spec": model_spec(self._model),
      "callbacks": [c.state_dict() for c in self.callbacks],
      "elapsed_s": self._elapsed_before,
      "history": self.history,
      "run_config": self.run_config,
      "start_model": self._start_model(),
    }

  def _start_model(self) -> dict[str, Any]:
    """:func:`model_structure` of the model this run started from, taken the first time a
    checkpoint is restored, the folder claimed or a checkpoint written (before any training,
    in ``fit``), so a reconfiguration later does not change it."""
    if getattr(self, "_start_structure", None) is None:
      self._start_structure = model_structure(self._model)
    return self._start_structure

  def _claim_store(self, overwrite: bool) -> None:
    """Make ``checkpoint_dir`` this run's own before anything is written into it.

    Checkpoints are numbered by epoch and ``fit`` resumes the highest number, so a fresh run
    writing next to another run's checkpoints would leave the other run's later epochs as
    "latest" and a resume would silently continue the wrong run.
    """
    self._start_model()
    if self.store is None or self._owns_store:
      return
    steps = self.store.all_steps()
    if steps and not overwrite:
      raise ValueError(
        f"checkpoint_dir {self.store.directory} already holds the checkpoints {steps} of "
        "another run: resume it (fit(resume=True)), pass overwrite=True to delete them, or "
        "use another checkpoint_dir"
      )
    if steps:
      self.store.clear()
    self._owns_store = True

  def save_checkpoint(self, loader: Any = None) -> None:
    """Write a checkpoint of the current state (no-op without ``checkpoint_dir``).

    Raises:
      ValueError: if ``checkpoint_dir`` holds another run's checkpoints (this trainer
        neither restored from it nor cleared it with ``fit(overwrite=True)``).
    """
    if self.store is None:
      return
    self._claim_store(overwrite=False)
    arrays = {"params": self.params, "rest": self.rest, "opt_state": self.opt_state}
    self.store.save(self.epoch, arrays, self._meta(loader))

  def _rebuild_model(self, spec: Any) -> nnx.Module:
    if self.model_builder is not None:
      return self.model_builder(spec)
    if getattr(self._model, "num_classes", None) is None:
      raise ValueError(
        "checkpoint: model spec differs from the current model's and no "
        "model_builder was given to rebuild it"
      )
    # The checkpoint restores every variable, conversion state (e.g. SDGP keys) included.
    return models.rebuild(self._model, spec)

  def restore_checkpoint(self, loader: Any = None, step: int | None = None) -> bool:
    """Restore the latest (or given) checkpoint; returns False if there is none.

    A damaged latest checkpoint (files truncated or missing) is renamed to
    ``<step>.damaged`` with a ``UserWarning`` naming it, and the newest intact one is
    restored instead.

    Raises:
      DamagedCheckpointError: if the given ``step`` is damaged, or every checkpoint is (the
        message names each one's step and path).
      ValueError: if the checkpoint belongs to a differently configured run (its stored
        ``run_config`` and this trainer's, both named) or to a run that started from another
        model (class, width spec or parameter paths and shapes, both named), or does not fit
        the model.
    """
    self._start_model()
    if self.store is None:
      return False
    if step is not None:
      self._restore_step(loader, step)
      return True
    damaged: list[DamagedCheckpointError] = []
    for candidate in reversed(self.store.all_steps()):
      try:
        self._restore_step(loader, candidate)
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

  def _restore_step(self, loader: Any, step: int) -> None:
    # Every read from the store happens before the trainer's state changes, so a damaged
    # checkpoint leaves the trainer as it was.
    meta = self.store.restore_meta(step)
    _check_run_config(meta.get("run_config"), self.run_config, self.store.directory)
    _check_start_model(meta.get("start_model"), self._start_model(), self.store.directory)
    model = self._model
    if meta.get("model_spec") is not None and meta["model_spec"] != model_spec(model):
      model = self._rebuild_model(decode_spec(meta["model_spec"]))
    _, _, params, rest = split_model(model)
    template = {"params": params, "rest": rest, "opt_state": jax.eval_shape(self.tx.init, params)}
    template["opt_state"] = jax.tree.map(
      lambda s: jnp.zeros(s.shape, s.dtype), template["opt_state"]
    )
    arrays, meta = self.store.restore(step, template)
    nnx.update(model, arrays["params"], arrays["rest"])
    self._set_model(model, arrays["opt_state"])
    self.epoch, self.step = int(meta["epoch"]), int(meta["step"])
    self._owns_store = True  # the restored run goes on in its own folder
    self.reference_batch_size = meta.get("reference_batch_size")
    pending = meta.get("pending_batch_size")
    self._pending_batch_size = (int(pending[0]), bool(pending[1])) if pending else None
    self.history = list(meta.get("history", []))
    self._elapsed_before = float(meta.get("elapsed_s", 0.0))
    for c, state in zip(self.callbacks, meta.get("callbacks", [])):
      c.load_state_dict(state)
    if loader is not None:
      if meta.get("batch_size") is not None and _loaders.batch_size(loader) is not None:
        _loaders.set_batch_size(loader, int(meta["batch_size"]))
      if meta.get("loader_state") is not None:
        _loaders.restore(loader, meta["loader_state"])

"""The method API: a pruning method as one value (:class:`Method`) and the run it is built for.

A pruning method touches a training run in up to three places: it wraps the optimizer, it may
swap some layers of the model before training, and it may act on the trainer between epochs.
:class:`Method` holds one function for each, so a training script is written once for all
methods (the dense baseline included) and two methods compose into one (:func:`compose`).

This module sits below the paper packages: each one's ``method(**config)`` preset builds a
:class:`Method` from it (routing one flat config with :func:`split_config`), and
:mod:`jaxprune.methods`, above them, names the presets in a registry. See that module for
the whole API and an example.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax
from flax import nnx

from jaxprune.train import LoaderView

__all__ = ["Method", "Run", "compose", "split_config"]


@dataclasses.dataclass(frozen=True)
class Run:
  """The facts of a training run that a method may need.

  Attributes:
    steps_per_epoch: optimizer steps per epoch (``len(train_loader)``); converts the epoch
      settings of a schedule (ClickTrain's stages) into steps.
    epochs: length of the run; presets place their default schedule inside it.
    image_shape: one training image, e.g. ``(32, 32, 3)``; needed by methods that trace the
      model (PruneTrain's cost accounting and batch growth).
  """

  steps_per_epoch: int
  epochs: int
  image_shape: tuple[int, ...] | None = None

  def __post_init__(self):
    for name in ("steps_per_epoch", "epochs"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.image_shape is not None:
      shape = tuple(self.image_shape)
      if len(shape) != 3 or any(not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(f"image_shape must be (height, width, channels), got {shape!r}")
      object.__setattr__(self, "image_shape", shape)

  @classmethod
  def from_loader(cls, loader: Any, *, epochs: int) -> Run:
    """The run of ``epochs`` epochs over ``loader`` (a :class:`jaxprune.data.Loader`).

    ``steps_per_epoch`` is ``len(loader)``; ``image_shape`` comes from ``loader.dataset``
    when the loader has one (:attr:`jaxprune.train.LoaderView.image_shape`).
    """
    image_shape = LoaderView(loader, "loader").image_shape
    return cls(steps_per_epoch=len(loader), epochs=epochs, image_shape=image_shape)


def _keep_inner(inner: optax.GradientTransformation, run: Run) -> optax.GradientTransformation:
  del run
  return inner


def _keep_model(model: nnx.Module) -> nnx.Module:
  return model


def _no_callbacks(run: Run) -> list[Any]:
  del run
  return []


@dataclasses.dataclass(frozen=True)
class Method:
  """A pruning method: an optimizer wrapper, a model converter and trainer callbacks.

  Attributes:
    name: the method's name (the registry name when it came from :func:`get`).
    make_tx: ``(inner, run) -> optax transform``: wraps the user's optimizer ``inner``.
    convert: ``model -> model`` applied once before training (may mutate in place).
    callbacks: ``run -> list`` of :class:`jaxprune.train.Trainer` callbacks.
    config: the settings the method was built with (for logs and ``run_config``).
  """

  name: str
  make_tx: Callable[[optax.GradientTransformation, Run], optax.GradientTransformation] = (
    dataclasses.field(default=_keep_inner, repr=False)
  )
  convert: Callable[[nnx.Module], nnx.Module] = dataclasses.field(default=_keep_model, repr=False)
  callbacks: Callable[[Run], Sequence[Any]] = dataclasses.field(default=_no_callbacks, repr=False)
  config: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def compose(*parts: Method, name: str | None = None) -> Method:
  """One method doing what several do: ``compose(a, b)`` wraps ``a``'s transform around ``b``'s.

  The first part is the outermost wrapper (``a.make_tx(b.make_tx(inner, run), run)``), so a
  method that must emit the final update (ClickTrain's hard masks) goes first. Converters run
  last part first; callbacks are concatenated in order.

  Args:
    *parts: the methods, outermost first.
    name: the result's name (default: the parts' names joined by ``+``).

  Returns:
    A :class:`Method`; its ``config`` maps each part's name to that part's config.

  Raises:
    ValueError: fewer than two parts.
  """
  if len(parts) < 2:
    raise ValueError(f"parts: compose needs at least two methods, got {len(parts)}")

  def make_tx(inner, run):
    for part in reversed(parts):
      inner = part.make_tx(inner, run)
    return inner

  def convert(model):
    for part in reversed(parts):
      model = part.convert(model)
    return model

  def callbacks(run):
    return [c for part in parts for c in part.callbacks(run)]

  return Method(
    name=name or "+".join(p.name for p in parts),
    make_tx=make_tx,
    convert=convert,
    callbacks=callbacks,
    config={p.name: dict(p.config) for p in parts},
  )


def _keyword_names(fn: Callable[..., Any], skip: Sequence[str] = ()) -> tuple[str, ...]:
  """Names ``fn`` accepts as keywords, minus ``skip``."""
  kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
  params = inspect.signature(fn).parameters.values()
  return tuple(p.name for p in params if p.kind in kinds and p.name not in skip)


def split_config(
  config: Mapping[str, Any],
  targets: Mapping[str, tuple[Callable[..., Any], Sequence[str]]],
  *,
  owner: str,
) -> dict[str, dict[str, Any]]:
  """Routes each config key to the one target whose signature accepts it.

  Presets use it to take one flat config for several callables (PruneTrain's optimizer and
  callback) without repeating their defaults.

  Args:
    config: the user's settings.
    targets: ``{label: (callable, names the preset sets itself)}``.
    owner: the method's name, for the error message.

  Returns:
    ``{label: settings for that callable}``.

  Raises:
    ValueError: keys no target accepts, or that the preset sets itself (named in the message).
  """
  accepted = {label: _keyword_names(fn, skip) for label, (fn, skip) in targets.items()}
  routed: dict[str, dict[str, Any]] = {label: {} for label in targets}
  unknown = []
  for key, value in config.items():
    label = next((label for label, names in accepted.items() if key in names), None)
    if label is None:
      unknown.append(key)
    else:
      routed[label][key] = value
  if unknown:
    names = sorted({n for names in accepted.values() for n in names})
    raise ValueError(
      f"unknown config key(s) {sorted(unknown)} for method {owner!r}; accepted: {', '.join(names)}"
    )
  return routed

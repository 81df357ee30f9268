"""The common method API: every pruning method as one value, and a registry of named methods.

A pruning method touches a training run in up to three places: it wraps the optimizer, it may
swap some layers of the model before training, and it may act on the trainer between epochs.
:class:`Method` holds one function for each, so a training script is written once for all
methods (the dense baseline included) and two methods compose into one:

* ``make_tx(inner, run)`` wraps the user's own Optax optimizer ``inner`` (ClickTrain,
  PruneTrain's group lasso; the dense baseline returns ``inner``). ``run`` is a :class:`Run`:
  the facts of the run a method needs to place its schedule (steps per epoch, epochs, image
  shape).
* ``convert(model)`` returns the model to train (SDGP swaps the convolutions; default: the
  model unchanged).
* ``callbacks(run)`` returns :class:`jaxprune.train.Trainer` callbacks (PruneTrain's
  reconfiguration; default: none).

Each paper package has a ``method(**config)`` preset that builds its :class:`Method`; the
registry names them (and their compositions) so scripts can pick methods by string:

====================  =====================================================================
``dense``             the inner optimizer unchanged
``clicktrain``        :func:`jaxprune.clicktrain.method` (the paper's stages, ``mode="paper"``)
``clicktrain-one-shot``  the same with ``mode="one_shot"`` (the authors' released code)
``prunetrain``        :func:`jaxprune.prunetrain.method` (group lasso + reconfiguration)
``sdgp``              :func:`jaxprune.sdgp.method` (N:M data-gradient pruning; config ``n``,
                      ``m``, ``method``: ``random``, ``magnitude``, ``rescaled_magnitude``,
                      ``mvue``)
``prunetrain+sdgp``   both: PruneTrain's optimizer and callback on an SDGP-converted model
``clicktrain+sdgp``   both: ClickTrain's optimizer on an SDGP-converted model
====================  =====================================================================

Example:
  >>> import optax
  >>> from jaxprune import methods
  >>> method = methods.get("sdgp", n=2, m=4, method="mvue")
  >>> run = methods.Run(steps_per_epoch=100, epochs=10)
  >>> tx = method.make_tx(optax.sgd(0.1, momentum=0.9), run)
  >>> sorted(methods.available())[:3]
  ['clicktrain', 'clicktrain+sdgp', 'clicktrain-one-shot']

  With a model and a trainer::

    model = method.convert(model)
    trainer = train.Trainer(model, method.make_tx(inner, run), callbacks=method.callbacks(run))
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax
from flax import nnx

__all__ = [
  "Method",
  "Run",
  "available",
  "compose",
  "get",
  "register",
  "split_config",
]


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
    when the loader has one.
    """
    images = getattr(getattr(loader, "dataset", None), "images", None)
    image_shape = tuple(int(d) for d in images.shape[1:]) if images is not None else None
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


# ----------------------------------------------------------------------------- registry

Factory = Callable[..., Method]

# Built-in factories are named by "module:attribute" and imported on first use: the paper
# packages import this module (for Method), so it must not import them at import time.
_REGISTRY: dict[str, Factory | str] = {
  "dense": "jaxprune.methods:_dense",
  "clicktrain": "jaxprune.clicktrain.preset:method",
  "clicktrain-one-shot": "jaxprune.clicktrain.preset:one_shot_method",
  "prunetrain": "jaxprune.prunetrain.preset:method",
  "sdgp": "jaxprune.sdgp.preset:method",
  "prunetrain+sdgp": "jaxprune.methods:_prunetrain_sdgp",
  "clicktrain+sdgp": "jaxprune.methods:_clicktrain_sdgp",
}


def _dense() -> Method:
  return Method(name="dense")


def _with_sdgp(outer: str) -> Factory:
  """A factory for ``<outer>+sdgp``: SDGP's keys go to SDGP, the rest to ``outer``."""

  def factory(**config: Any) -> Method:
    from jaxprune.sdgp import preset as sdgp_preset

    sdgp_keys = _keyword_names(sdgp_preset.method)
    sdgp_config = {k: v for k, v in config.items() if k in sdgp_keys}
    outer_config = {k: v for k, v in config.items() if k not in sdgp_keys}
    return compose(
      _resolve(outer)(**outer_config),
      sdgp_preset.method(**sdgp_config),
      name=f"{outer}+sdgp",
    )

  return factory


_prunetrain_sdgp = _with_sdgp("prunetrain")
_clicktrain_sdgp = _with_sdgp("clicktrain")


def _resolve(name: str) -> Factory:
  factory = _REGISTRY[name]
  if isinstance(factory, str):
    module, attribute = factory.split(":")
    factory = getattr(importlib.import_module(module), attribute)
  return factory


def available() -> tuple[str, ...]:
  """The registered method names, sorted."""
  return tuple(sorted(_REGISTRY))


def register(name: str, factory: Factory) -> None:
  """Registers ``factory(**config) -> Method`` under ``name``.

  Raises:
    ValueError: ``name`` is empty or already registered, or ``factory`` is not callable.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"name must be a non-empty string, got {name!r}")
  if name in _REGISTRY:
    raise ValueError(f"name {name!r} is already registered; registered: {', '.join(available())}")
  if not callable(factory):
    raise ValueError(f"factory must be callable, got {factory!r}")
  _REGISTRY[name] = factory


def get(name: str, **config: Any) -> Method:
  """The method registered as ``name``, built with ``config``.

  Args:
    name: one of :func:`available`.
    **config: the method's settings (see its preset, e.g. :func:`jaxprune.sdgp.method`).

  Returns:
    A :class:`Method` named ``name``.

  Raises:
    ValueError: an unknown ``name`` (the message lists the available ones), a config key the
      method does not take (named in the message), or a bad config value.
  """
  if name not in _REGISTRY:
    raise ValueError(f"unknown method {name!r}; available: {', '.join(available())}")
  factory = _resolve(name)
  params = inspect.signature(factory).parameters.values()
  if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    accepted = _keyword_names(factory)
    unknown = sorted(set(config) - set(accepted))
    if unknown:
      raise ValueError(
        f"unknown config key(s) {unknown} for method {name!r}; accepted: "
        f"{', '.join(accepted) or 'none'}"
      )
  return dataclasses.replace(factory(**config), name=name)

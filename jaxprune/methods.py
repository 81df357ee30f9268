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
  reconfiguration, ClickTrain's BatchNorm re-estimate at the hard prune; default: none).

Each paper package has a ``method(**config)`` preset that builds its :class:`Method` (the types
live in :mod:`jaxprune.method_api`, below the paper packages, and are re-exported here); the
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
import inspect
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from jaxprune import clicktrain, prunetrain, sdgp
from jaxprune.method_api import Method, Run, _keyword_names, compose, split_config

__all__ = [
  "PAPERS",
  "Method",
  "Paper",
  "Run",
  "available",
  "compose",
  "get",
  "register",
  "split_config",
]

# ----------------------------------------------------------------------------- registry

Factory = Callable[..., Method]


def _dense() -> Method:
  return Method(name="dense")


def _with_sdgp(outer: Factory) -> Factory:
  """A factory for ``<outer>+sdgp``: SDGP's keys go to SDGP, the rest to ``outer``."""

  def factory(**config: Any) -> Method:
    sdgp_keys = _keyword_names(sdgp.method)
    sdgp_config = {k: v for k, v in config.items() if k in sdgp_keys}
    outer_config = {k: v for k, v in config.items() if k not in sdgp_keys}
    outer_method = outer(**outer_config)
    return compose(outer_method, sdgp.method(**sdgp_config), name=f"{outer_method.name}+sdgp")

  return factory


# ----------------------------------------------------------------------------- the papers


@dataclasses.dataclass(frozen=True)
class Paper:
  """One paper the library implements: the one place that says which papers there are.

  The package face (``jaxprune.<name>``), the registry below, the import-floor test and the
  experiments' results folders all read :data:`PAPERS`, so a new paper is one entry here (and
  its package); see "Adding a method" in docs/design.md.

  Attributes:
    package: the paper's package, ``jaxprune.<name>``.
    methods: the registered name -> factory of each preset the paper contributes.
    results: the folder under ``experiments/results/`` its tables and figures write to.
  """

  package: ModuleType
  methods: Mapping[str, Factory]
  results: str

  @property
  def name(self) -> str:
    """The package's own name (``"clicktrain"`` for ``jaxprune.clicktrain``)."""
    return self.package.__name__.rpartition(".")[2]


# This module sits above the paper packages and imports them; they import only
# :mod:`jaxprune.method_api`, never this list or the registry.
PAPERS: tuple[Paper, ...] = (
  Paper(
    clicktrain,
    {"clicktrain": clicktrain.method, "clicktrain-one-shot": clicktrain.preset.one_shot_method},
    results="clicktrain",
  ),
  Paper(prunetrain, {"prunetrain": prunetrain.method}, results="prunetrain"),
  Paper(sdgp, {"sdgp": sdgp.method}, results="sdgp"),
)

# The built-in presets: the dense baseline, every paper's, and the compositions with SDGP.
_REGISTRY: dict[str, Factory] = {
  "dense": _dense,
  **{name: factory for paper in PAPERS for name, factory in paper.methods.items()},
  "prunetrain+sdgp": _with_sdgp(prunetrain.method),
  "clicktrain+sdgp": _with_sdgp(clicktrain.method),
}


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
  factory = _REGISTRY[name]
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

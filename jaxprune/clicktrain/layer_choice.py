"""Which convs ClickTrain prunes, decided from the model's structure rather than its names.

ClickTrain prunes every conv but the stem and the 1x1 projection shortcuts (the authors'
released code). The transform sees only parameters, so its default
(:func:`~jaxprune.clicktrain.config.default_layer_filter`) knows a shortcut by its name; a
model that calls its projection ``b2_proj`` would have it pruned, one that calls it
``shortcut`` would not. Here the rule is read off the traced forward pass
(:func:`jaxprune.flops.projection_shortcuts`: a 1x1 conv alone on the skip path of a residual
add):

* :func:`layer_filter_for` builds the ``layer_filter`` that decides by structure: pass it to
  :func:`~jaxprune.clicktrain.clicktrain` (or ``methods.get("clicktrain", layer_filter=...)``).
* :class:`LayerChoiceCheck`, a trainer hook the :func:`~jaxprune.clicktrain.method` preset
  attaches when no ``layer_filter`` is given, refuses at fit start, before any step, a run
  whose name-based choice differs from the structural one, naming the layers and the fix.

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from jaxprune.clicktrain.config import LayerFilter, choose_layer, default_layer_filter
from jaxprune.clicktrain.readouts import find_state
from jaxprune.flops import projection_shortcuts
from jaxprune.paths import path_string
from jaxprune.train import Callback, TrainerLike

__all__ = ["LayerChoiceCheck", "layer_choice_differences", "layer_filter_for"]


def layer_filter_for(model: nnx.Module, input_shape: Sequence[int]) -> LayerFilter:
  """ClickTrain's layer choice for ``model``, with its projection shortcuts found by structure.

  Args:
    model: the NNX model to be trained.
    input_shape: one input batch's shape, e.g. ``(1, 32, 32, 3)`` (traced, not run).

  Returns:
    A ``layer_filter(path, shape)``: as
    :func:`~jaxprune.clicktrain.config.default_layer_filter`, except that a 1x1 conv is left
    dense exactly when its output is the skip path of a residual add (whatever its name).

  Raises:
    ValueError: an ``input_shape`` the model does not accept.

  Example::

    tx = clicktrain.clicktrain(inner, steps_per_epoch=390, hard_prune_epoch=95,
                               layer_filter=clicktrain.layer_filter_for(model, (1, 32, 32, 3)))
  """
  shortcuts = projection_shortcuts(model, input_shape)

  def layer_filter(path: str, shape: tuple[int, ...]) -> str | None:
    return choose_layer(shape, shortcut=path in shortcuts)

  layer_filter.choose_layer_rule = True  # the transform names the kernel sizes it skips
  return layer_filter


def checked_default_layer_filter(path: str, shape: tuple[int, ...]) -> str | None:
  """The name-based default, for a run whose :class:`LayerChoiceCheck` checks it.

  The check compares it with the structure at fit start, so the transform does not warn that
  it goes by name.
  """
  return default_layer_filter(path, shape)


checked_default_layer_filter.choose_layer_rule = True


def layer_choice_differences(model: nnx.Module, input_shape: Sequence[int]) -> dict[str, str]:
  """The layers of ``model`` the name-based default chooses otherwise than the structure.

  Returns:
    ``{path: what differs}``, empty when the two agree (e.g. on every :mod:`jaxprune.models`
    network).
  """
  structural = layer_filter_for(model, input_shape)
  params = nnx.state(model, nnx.Param)
  differences = {}
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    path, shape = path_string(key_path), tuple(np.shape(leaf))
    by_name, by_structure = default_layer_filter(path, shape), structural(path, shape)
    if by_name != by_structure:
      differences[path] = (
        "a 1x1 projection shortcut (its output is the skip path of a residual add) that the "
        "name-based default would prune"
        if by_structure is None
        else "a 1x1 conv that the name-based default leaves dense as a shortcut, though it is "
        "not on a residual skip path"
      )
  return differences


class LayerChoiceCheck(Callback):
  """Trainer hook: refuses a run whose layer choice differs from the model's structure.

  At fit start, before any step, it refuses a ClickTrain run whose default, name-based layer choice
  differs from the model's structure (see the module docstring).

  Args:
    image_shape: one training image, ``(H, W, C)`` (``methods.Run.image_shape``); ``None``:
      the check cannot trace the model and warns that the choice is by name.

  Raises:
    ValueError: at fit start, naming each layer that differs and the ``layer_filter`` that
      decides by structure.
  """

  def __init__(self, image_shape: Sequence[int] | None):
    self.image_shape = None if image_shape is None else tuple(int(d) for d in image_shape)

  def on_fit_start(self, trainer: TrainerLike) -> None:
    if trainer.step:  # a resumed run was checked when it started
      return
    if self.image_shape is None:
      warnings.warn(
        "ClickTrain chooses its layers by name (1x1 convs on a 'shortcut' / 'downsample' path "
        "stay dense): the image shape is unknown, so the model's structure is not checked; pass "
        "layer_filter=clicktrain.layer_filter_for(model, input_shape) to decide by structure",
        UserWarning,
        stacklevel=2,
      )
      return
    find_state(trainer.opt_state)  # a ClickTrain run (named error otherwise)
    differences = layer_choice_differences(trainer.model, (1, *self.image_shape))
    if differences:
      listed = "; ".join(f"{path}: {why}" for path, why in differences.items())
      raise ValueError(
        f"layer_filter: ClickTrain's default chooses layers by name, and here that differs from "
        f"the model's structure: {listed}. Pass layer_filter=clicktrain.layer_filter_for(model, "
        f"{(1, *self.image_shape)}) to decide by structure (or a layer_filter of your own)"
      )

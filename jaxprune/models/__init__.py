"""Flax NNX models built from explicit width specs (so pruned models can be rebuilt smaller).

Registry: ``create(name, *, num_classes, rngs)``, ``available()``. Families follow the paper
whose definition they use: ``prunetrain-*``, ``clicktrain-*``, ``sdgp-resnet9``, ``imagenet-*``.

Models own their rebuild: every spec has ``layer_widths()`` / ``with_widths(widths,
removed_blocks=...)`` (widths keyed by the layer's attribute path), and ``rebuild(model, spec)``
builds a model of the same class from a new spec, re-applying the conversions recorded on the
old one (``record_conversion``).

Mixed precision as in Flax: every model takes ``dtype`` (compute; ``jnp.bfloat16`` for mixed
precision) and ``param_dtype`` (float32 by default); BatchNorm statistics and the logits stay
float32, and ``rebuild`` and the converters keep the dtype.

Convolution wrappers share one protocol (``pluggable_conv``): a ``PluggableConv`` runs a pluggable
conv function, composed by wrapping, with an explicit per-call key.
"""

from jaxprune.models.conversions import (
  Conversion,
  applied_conversions,
  channel_multiple,
  rebuild,
  record_conversion,
  replace_submodule,
  submodule,
)
from jaxprune.models.layers import BasicBlock, BlurPool, Bottleneck, ConvBN
from jaxprune.models.pluggable_conv import (
  BoundConv,
  ConvFunction,
  ConvKey,
  PluggableConv,
  base_function,
  conv_sharing_variables,
  next_call_key,
  with_base,
)
from jaxprune.models.registry import available, create, default_spec, param_count
from jaxprune.models.resnet import (
  BlockSpec,
  ResNet,
  ResNetSpec,
  StageSpec,
  clicktrain_resnet_spec,
  imagenet_resnet_spec,
  prunetrain_resnet_spec,
)
from jaxprune.models.resnet9 import ResNet9, ResNet9Spec, sdgp_resnet9_spec
from jaxprune.models.vgg import VGG, VGGSpec, clicktrain_vgg_spec, prunetrain_vgg_spec

__all__ = [
  "Conversion",
  "applied_conversions",
  "channel_multiple",
  "rebuild",
  "record_conversion",
  "replace_submodule",
  "submodule",
  "BoundConv",
  "ConvFunction",
  "ConvKey",
  "PluggableConv",
  "base_function",
  "conv_sharing_variables",
  "next_call_key",
  "with_base",
  "BasicBlock",
  "BlurPool",
  "BlockSpec",
  "Bottleneck",
  "ConvBN",
  "ResNet",
  "ResNet9",
  "ResNet9Spec",
  "ResNetSpec",
  "StageSpec",
  "VGG",
  "VGGSpec",
  "available",
  "clicktrain_resnet_spec",
  "clicktrain_vgg_spec",
  "create",
  "default_spec",
  "imagenet_resnet_spec",
  "param_count",
  "prunetrain_resnet_spec",
  "prunetrain_vgg_spec",
  "sdgp_resnet9_spec",
]

"""Hand-written Flax NNX models that PruneTrain's traced reconfiguration is checked on.

Each is written as a user would write it, with nothing from :mod:`jaxprune.models`: plain
``nnx.Conv`` / ``nnx.Linear`` / norms composed in ``__call__``. Together they cover the
structures the channel graph must follow: projection shortcuts, depthwise convs inside an
inverted residual, concatenation, LayerNorm + a Linear MLP, a transformer's MLP block, a
channel shuffle, a flatten into a Linear and an MLP; and transformers (hand-written attention,
grouped-query attention with SwiGLU, ``nnx.MultiHeadAttention``, a decoder-only language model
over tokens). Every model takes ``(N, 32, 32, 3)`` images except those :data:`INPUTS` names.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprune.models.transformer import DecoderLM, ViT

__all__ = ["ARCHITECTURES", "INPUTS", "Architecture", "example_input", "input_spec"]


def _conv(cin: int, cout: int, k: int, rngs: nnx.Rngs, **kwargs) -> nnx.Conv:
  kwargs.setdefault("use_bias", False)
  return nnx.Conv(cin, cout, (k, k), padding="SAME", rngs=rngs, **kwargs)


class ProjectionResNet(nnx.Module):
  """A small ResNet with 1x1 projection shortcuts, written by hand."""

  def __init__(self, rngs: nnx.Rngs, width: int = 16, num_classes: int = 10):
    self.stem = _conv(3, width, 3, rngs)
    self.stem_bn = nnx.BatchNorm(width, rngs=rngs)
    self.blocks = nnx.List([_Block(width, width, 1, rngs), _Block(width, 2 * width, 2, rngs)])
    self.fc = nnx.Linear(2 * width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem_bn(self.stem(x)))
    for block in self.blocks:
      x = block(x)
    return self.fc(x.mean(axis=(1, 2)))


class _Block(nnx.Module):
  def __init__(self, cin: int, cout: int, stride: int, rngs: nnx.Rngs):
    self.a = _conv(cin, cout, 3, rngs, strides=stride)
    self.a_bn = nnx.BatchNorm(cout, rngs=rngs)
    self.b = _conv(cout, cout, 3, rngs)
    self.b_bn = nnx.BatchNorm(cout, rngs=rngs)
    self.proj = _conv(cin, cout, 1, rngs, strides=stride)
    self.proj_bn = nnx.BatchNorm(cout, rngs=rngs)

  def __call__(self, x):
    y = self.b_bn(self.b(nnx.relu(self.a_bn(self.a(x)))))
    return nnx.relu(y + self.proj_bn(self.proj(x)))


class InvertedResidual(nnx.Module):
  """MobileNetV2: 1x1 expand, 3x3 depthwise, 1x1 project, identity shortcut."""

  def __init__(self, rngs: nnx.Rngs, width: int = 16, expand: int = 4, num_classes: int = 10):
    hidden = width * expand
    self.stem = _conv(3, width, 3, rngs)
    self.stem_bn = nnx.BatchNorm(width, rngs=rngs)
    self.expand = _conv(width, hidden, 1, rngs)
    self.expand_bn = nnx.BatchNorm(hidden, rngs=rngs)
    self.depthwise = _conv(hidden, hidden, 3, rngs, feature_group_count=hidden)
    self.depthwise_bn = nnx.BatchNorm(hidden, rngs=rngs)
    self.project = _conv(hidden, width, 1, rngs)
    self.project_bn = nnx.BatchNorm(width, rngs=rngs)
    self.fc = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu6(self.stem_bn(self.stem(x)))
    y = nnx.relu6(self.expand_bn(self.expand(x)))
    y = nnx.relu6(self.depthwise_bn(self.depthwise(y)))
    x = x + self.project_bn(self.project(y))
    return self.fc(x.mean(axis=(1, 2)))


class DenseConcat(nnx.Module):
  """DenseNet / UNet style: every layer reads the concatenation of all earlier outputs."""

  def __init__(self, rngs: nnx.Rngs, width: int = 8, growth: int = 8, num_classes: int = 10):
    self.stem = _conv(3, width, 3, rngs)
    self.layers = nnx.List(
      [_conv(width + i * growth, growth, 3, rngs, use_bias=True) for i in range(3)]
    )
    self.norms = nnx.List([nnx.BatchNorm(width + i * growth, rngs=rngs) for i in range(3)])
    self.fc = nnx.Linear(width + 3 * growth, num_classes, rngs=rngs)

  def __call__(self, x):
    x = self.stem(x)
    for norm, layer in zip(self.norms, self.layers):
      x = jnp.concatenate([x, layer(nnx.relu(norm(x)))], axis=-1)
    return self.fc(x.mean(axis=(1, 2)))


class ConvNeXtBlock(nnx.Module):
  """ConvNeXt: 7x7 depthwise, LayerNorm, Linear 4x MLP with GELU, layer scale, residual."""

  def __init__(self, rngs: nnx.Rngs, width: int = 16, num_classes: int = 10):
    self.stem = _conv(3, width, 4, rngs, strides=4)
    self.depthwise = nnx.Conv(
      width, width, (7, 7), padding="SAME", feature_group_count=width, rngs=rngs
    )
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)
    self.gamma = nnx.Param(jnp.full((width,), 1e-1))
    self.fc = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = self.stem(x)
    y = self.down(nnx.gelu(self.up(self.norm(self.depthwise(x)))))
    x = x + self.gamma[...] * y
    return self.fc(x.mean(axis=(1, 2)))


class ViTMLPBlock(nnx.Module):
  """A transformer's MLP block on tokens ``(N, T, D)``: LayerNorm, Linear, GELU, Linear, add."""

  def __init__(self, rngs: nnx.Rngs, dim: int = 16, hidden: int = 64, num_classes: int = 10):
    self.embed = nnx.Linear(12, dim, rngs=rngs)
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, dim, rngs=rngs)
    self.fc = nnx.Linear(dim, num_classes, rngs=rngs)

  def __call__(self, x):
    # A 16x16 subsample of the image as 64 tokens of 2x2x3 values.
    n = x.shape[0]
    tokens = x[:, ::2, ::2, :].reshape(n, 8, 2, 8, 2, 3).transpose(0, 1, 3, 2, 4, 5)
    tokens = self.embed(tokens.reshape(n, 64, 12))
    tokens = tokens + self.down(nnx.gelu(self.up(self.norm(tokens))))
    return self.fc(tokens.mean(axis=1))


class ShuffleUnit(nnx.Module):
  """ShuffleNet: grouped 1x1 conv, channel shuffle, depthwise 3x3, grouped 1x1 conv, add."""

  def __init__(self, rngs: nnx.Rngs, width: int = 16, groups: int = 4, num_classes: int = 10):
    self.groups = groups
    self.stem = _conv(3, width, 3, rngs)
    self.reduce = _conv(width, width, 1, rngs, feature_group_count=groups)
    self.reduce_bn = nnx.BatchNorm(width, rngs=rngs)
    self.depthwise = _conv(width, width, 3, rngs, feature_group_count=width)
    self.expand = _conv(width, width, 1, rngs, feature_group_count=groups)
    self.fc = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = self.stem(x)
    y = nnx.relu(self.reduce_bn(self.reduce(x)))
    n, h, w, c = y.shape
    y = y.reshape(n, h, w, self.groups, c // self.groups).swapaxes(3, 4).reshape(n, h, w, c)
    y = self.expand(self.depthwise(y))
    return self.fc(nnx.relu(x + y).mean(axis=(1, 2)))


class FlattenCNN(nnx.Module):
  """Conv, pool, flatten into a Linear: each channel is a block of the Linear's rows."""

  def __init__(self, rngs: nnx.Rngs, width: int = 8, num_classes: int = 10):
    self.conv = _conv(3, width, 3, rngs, use_bias=True)
    self.hidden = nnx.Linear(8 * 8 * width, 32, rngs=rngs)
    self.fc = nnx.Linear(32, num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.max_pool(nnx.relu(self.conv(x)), (4, 4), strides=(4, 4))
    return self.fc(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


class MLP(nnx.Module):
  """Linear -> Linear chains on flattened images (hidden units are the channels)."""

  def __init__(self, rngs: nnx.Rngs, hidden: int = 32, num_classes: int = 10):
    self.layers = nnx.List(
      [nnx.Linear(32 * 32 * 3, hidden, rngs=rngs), nnx.Linear(hidden, hidden, rngs=rngs)]
    )
    self.fc = nnx.Linear(hidden, num_classes, rngs=rngs)

  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    for layer in self.layers:
      x = nnx.relu(layer(x))
    return self.fc(x)


def ViTMultiHead(rngs: nnx.Rngs) -> nnx.Module:
  """A two-block ViT, hand-written multi-head attention (einsums over heads), GELU MLP."""
  return ViT(dim=32, depth=2, num_heads=4, head_dim=8, mlp_hidden=64, rngs=rngs)


def ViTGroupedQuery(rngs: nnx.Rngs) -> nnx.Module:
  """A two-block ViT with grouped-query attention (8 query heads, 2 kv heads), SwiGLU, RMSNorm."""
  return ViT(
    dim=32,
    depth=2,
    num_heads=8,
    head_dim=4,
    num_kv_heads=2,
    mlp_hidden=64,
    gated=True,
    norm="rms",
    rngs=rngs,
  )


def ByteLM(rngs: nnx.Rngs) -> nnx.Module:
  """A two-block decoder-only LM over bytes: token embedding, grouped-query causal attention
  (4 query heads, 2 kv heads), SwiGLU, RMSNorm, an untied output projection."""
  return DecoderLM(
    vocab=256,
    context=32,
    dim=32,
    depth=2,
    num_heads=4,
    head_dim=8,
    num_kv_heads=2,
    mlp_hidden=64,
    rngs=rngs,
  )


class FlaxAttentionViT(nnx.Module):
  """Patches, one pre-norm ``nnx.MultiHeadAttention`` block (``LinearGeneral`` kernels with a
  heads axis) and an MLP, mean-pooled logits."""

  def __init__(self, rngs: nnx.Rngs, dim: int = 32, num_classes: int = 10):
    self.embed = nnx.Linear(192, dim, rngs=rngs)
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads=4, in_features=dim, qkv_features=dim, decode=False, rngs=rngs
    )
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.down = nnx.Linear(2 * dim, dim, rngs=rngs)
    self.fc = nnx.Linear(dim, num_classes, rngs=rngs)

  def __call__(self, x):
    n = x.shape[0]  # 16 tokens of 8x8x3 patches
    t = x.reshape(n, 4, 8, 4, 8, 3).transpose(0, 1, 3, 2, 4, 5)
    t = self.embed(t.reshape(n, 16, 192))
    t = t + self.attn(self.norm(t))
    t = t + self.down(nnx.gelu(self.up(self.mlp_norm(t))))
    return self.fc(t.mean(axis=1))


Architecture = Callable[[nnx.Rngs], nnx.Module]
# name -> builder; every one takes (N, 32, 32, 3) images.
ARCHITECTURES: dict[str, Architecture] = {
  "hand-written ResNet (projection shortcuts)": ProjectionResNet,
  "MobileNetV2 inverted residual (depthwise)": InvertedResidual,
  "DenseNet-style concatenation": DenseConcat,
  "ConvNeXt block (7x7 depthwise, LayerNorm, MLP)": ConvNeXtBlock,
  "ViT MLP block (tokens)": ViTMLPBlock,
  "ViT, multi-head attention (hand-written)": ViTMultiHead,
  "ViT, grouped-query attention + SwiGLU + RMSNorm": ViTGroupedQuery,
  "nnx.MultiHeadAttention block": FlaxAttentionViT,
  "decoder-only byte LM (GQA + SwiGLU, token input)": ByteLM,
  "ShuffleNet unit (grouped 1x1, channel shuffle)": ShuffleUnit,
  "conv + flatten into Linear": FlattenCNN,
  "MLP": MLP,
}


# name -> (input shape at batch 1, dtype, number of classes per output position) for the models
# that do not take images: token ids in [0, vocabulary), next-token logits at every position.
INPUTS: dict[str, tuple[tuple[int, ...], jnp.dtype, int]] = {
  "decoder-only byte LM (GQA + SwiGLU, token input)": ((1, 32), jnp.int32, 256),
}
_IMAGES = ((1, 32, 32, 3), jnp.float32, 10)


def input_spec(name: str) -> tuple[tuple[int, ...], jnp.dtype, int]:
  """``(shape at batch 1, dtype, classes)`` of architecture ``name``'s input."""
  return INPUTS.get(name, _IMAGES)


def example_input(name: str, key: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
  """A random batch for architecture ``name``: ``(inputs, labels)``, labels of the logits'
  leading shape (one per image, or one per token)."""
  shape, dtype, classes = input_spec(name)
  k_in, k_lab = jax.random.split(key)
  if jnp.issubdtype(dtype, jnp.integer):
    inputs = jax.random.randint(k_in, (batch, *shape[1:]), 0, classes, dtype)
    return inputs, jax.random.randint(k_lab, (batch, *shape[1:]), 0, classes)
  inputs = jax.random.normal(k_in, (batch, *shape[1:]), dtype)
  return inputs, jax.random.randint(k_lab, (batch,), 0, classes)

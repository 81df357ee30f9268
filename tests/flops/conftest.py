"""Small models and conv helpers shared by the jaxprune.flops tests, defined independently of
jaxprune.models so that the hand counts do not depend on the library's definitions."""

from __future__ import annotations

import jax
import pytest
from flax import nnx


class ConvBNLinear(nnx.Module):
  """3x3 conv 3→8 (SAME) → BN → ReLU → global average pool → Linear 8→10."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), padding="SAME", use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.linear = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv(x)))
    return self.linear(x.mean(axis=(1, 2)))


class ConvBNAct(nnx.Module):
  def __init__(self, cin, cout, k, stride, rngs):
    self.conv = nnx.Conv(cin, cout, (k, k), strides=stride, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(cout, rngs=rngs)

  def __call__(self, x):
    return self.bn(self.conv(x))


class ResidualBlock(nnx.Module):
  """relu(conv2(relu(conv1(x))) + shortcut(x)) with a strided 1x1 projection shortcut."""

  def __init__(self, cin, cout, stride, rngs):
    self.conv1 = ConvBNAct(cin, cout, 3, stride, rngs)
    self.conv2 = ConvBNAct(cout, cout, 3, 1, rngs)
    self.shortcut = ConvBNAct(cin, cout, 1, stride, rngs)

  def __call__(self, x):
    y = self.conv2(nnx.relu(self.conv1(x)))
    return nnx.relu(y + self.shortcut(x))


class TinyResNet(nnx.Module):
  def __init__(self, rngs):
    self.stem = ConvBNAct(3, 4, 3, 1, rngs)
    self.stages = nnx.List([nnx.List([ResidualBlock(4, 8, 2, rngs)])])
    self.head = nnx.Linear(8, 5, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    for stage in self.stages:
      for block in stage:
        x = block(x)
    return self.head(x.mean(axis=(1, 2)))


def _abstract(model_class, *args):
  """The model with shape-only weights: FLOPs need no values, and eager init is slow on CPU."""
  return nnx.eval_shape(lambda: model_class(*args, nnx.Rngs(0)))


def _conv(x, w, strides=(1, 1), padding="SAME", groups=1):
  return jax.lax.conv_general_dilated(
    x,
    w,
    strides,
    padding,
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
    feature_group_count=groups,
  )


def _single_conv_fn(strides, padding, groups):
  return lambda p, x: _conv(x, p["w"], strides, padding, groups)


@pytest.fixture
def conv_bn_linear():
  """Abstract :class:`ConvBNLinear` (shape-only weights)."""
  return _abstract(ConvBNLinear)


@pytest.fixture
def tiny_resnet():
  """Abstract :class:`TinyResNet` (shape-only weights)."""
  return _abstract(TinyResNet)


@pytest.fixture
def conv():
  """``conv(x, w, strides=(1, 1), padding="SAME", groups=1)``: an NHWC × HWIO conv."""
  return _conv


@pytest.fixture
def single_conv_fn():
  """``single_conv_fn(strides, padding, groups)`` → ``fn(params, x)`` convolving ``x`` once."""
  return _single_conv_fn

"""SDGP's released-code re-initialisation of converted convs, and the paper preset."""

import functools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxprune import sdgp
from jaxprune.models.layers import torch_default_init


class _Net(nnx.Module):
  """A stem (3 inputs: never converted), a wide conv and a grouped conv with bias."""

  def __init__(self, rngs):
    # torch_default_init draws from the one sampler the re-initialisation also compiles.
    conv = functools.partial(nnx.Conv, kernel_size=(3, 3), kernel_init=torch_default_init)
    self.stem = conv(3, 32, use_bias=False, rngs=rngs)
    self.wide = conv(32, 64, use_bias=False, rngs=rngs)
    self.grouped = conv(64, 32, feature_group_count=4, rngs=rngs)
    self.grouped.bias[...] = jax.numpy.ones(32)

  def __call__(self, x):
    return self.grouped(self.wide(self.stem(x)))


@pytest.fixture(scope="module")
def net():
  """One built net; each test converts its own ``nnx.clone`` (building is the slow part)."""
  return _Net(nnx.Rngs(0))


def _kernels(model):
  return {k: np.asarray(getattr(model, k).kernel[...]) for k in ("stem", "wide", "grouped")}


def test_reinit_draws_kaiming_uniform_relu_and_a_seed_reproduces_it(net):
  before = _kernels(net)
  model = sdgp.convert_model(nnx.clone(net), n=2, m=4, method="magnitude", reinit=True, seed=5)
  after = _kernels(model)
  np.testing.assert_array_equal(after["stem"], before["stem"])  # not converted, not touched
  # fan_in = kh * kw * (in / groups): 3*3*32 and 3*3*(64/4).
  for name, fan_in in (("wide", 9 * 32), ("grouped", 9 * 16)):
    w = after[name]
    bound = math.sqrt(6.0 / fan_in)
    assert not np.array_equal(w, before[name])
    assert np.abs(w).max() <= bound
    assert np.abs(w).max() > 0.995 * bound  # the support reaches the bound
    # U(-b, b): mean 0, variance b^2 / 3 = 2 / fan_in (He et al.'s ReLU variance).
    n = w.size
    assert abs(w.mean()) < 4 * bound / math.sqrt(3 * n)
    np.testing.assert_allclose(w.var(), 2.0 / fan_in, rtol=0.05)
  np.testing.assert_array_equal(np.asarray(model.grouped.bias[...]), 0.0)
  different_init = nnx.clone(net)
  different_init.wide.kernel[...] = different_init.wide.kernel[...] + 1.0
  again = sdgp.convert_model(different_init, n=2, m=4, method="magnitude", reinit=True, seed=5)
  other = sdgp.convert_model(nnx.clone(net), n=2, m=4, method="magnitude", reinit=True, seed=6)
  for name in ("wide", "grouped"):
    np.testing.assert_array_equal(_kernels(again)[name], after[name])  # seed, not model init
    assert not np.array_equal(_kernels(other)[name], after[name])


def test_default_conversion_keeps_every_kernel_bit_for_bit(net):
  before = _kernels(net)
  model = sdgp.convert_model(nnx.clone(net), n=2, m=4, method="magnitude")
  for name, kernel in _kernels(model).items():
    np.testing.assert_array_equal(kernel, before[name])
  np.testing.assert_array_equal(np.asarray(model.grouped.bias[...]), 1.0)


def test_reinit_rejects_non_bools(net):
  with pytest.raises(ValueError, match="^reinit must be a bool"):
    sdgp.convert_model(nnx.clone(net), n=2, m=4, method="magnitude", reinit=1)
  with pytest.raises(ValueError, match="^reinit must be a bool"):
    sdgp.method(reinit="yes")


def test_paper_preset_reinitialises_and_converts_the_cifar_dense_row_as_4_of_4(net):
  dense = sdgp.paper_method("dense")
  assert dense.name == "dense"
  assert dense.config == {
    "n": 4,
    "m": 4,
    "method": "magnitude",
    "min_in_channels": 4,
    "seed": 0,
    "backend": "auto",
    "reinit": True,
  }
  before = _kernels(net)
  model = dense.convert(nnx.clone(net))
  assert isinstance(model.wide, sdgp.SDGPConv) and (model.wide.n, model.wide.m) == (4, 4)
  assert not np.array_equal(_kernels(model)["wide"], before["wide"])
  pruned = sdgp.paper_method("random", n=1, m=4)
  assert pruned.config["reinit"] and pruned.config["n"] == 1
  # The ImageNet script converts only when n < m: its dense row is the plain model.
  imagenet_dense = sdgp.paper_method("dense", dataset="imagenet")
  plain = nnx.clone(net)
  assert imagenet_dense.convert(plain).wide is plain.wide
  assert sdgp.method().config["reinit"] is False  # the library default keeps kernels


def test_paper_preset_bad_arguments():
  with pytest.raises(ValueError, match="^row must be 'dense' or one of"):
    sdgp.paper_method("max")
  with pytest.raises(ValueError, match="^dataset must be one of"):
    sdgp.paper_method("dense", dataset="mnist")

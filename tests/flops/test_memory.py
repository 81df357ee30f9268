"""Tests for jaxprune.flops.memory: BatchNorm memory traffic."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxprune import flops


def test_batchnorm_traffic_found_by_tracing(tiny_resnet, single_conv_fn):
  model = tiny_resnet
  traffic = flops.batchnorm_traffic(model, (2, 8, 8, 3))
  names = [t.name for t in traffic]
  assert names == [
    "stem/bn",
    "stages/0/0/conv1/bn",
    "stages/0/0/conv2/bn",
    "stages/0/0/shortcut/bn",
  ]
  shapes = [t.activation_shape for t in traffic]
  assert shapes == [(2, 8, 8, 4), (2, 4, 4, 8), (2, 4, 4, 8), (2, 4, 4, 8)]
  stem = traffic[0]
  assert stem.activation_bytes == 2 * 8 * 8 * 4 * 4  # float32
  # forward: 2 reads + 1 write; backward: 4 reads + 1 write; inference: 1 read + 1 write.
  assert (stem.forward_bytes, stem.backward_bytes, stem.inference_bytes) == (
    3 * stem.activation_bytes,
    5 * stem.activation_bytes,
    2 * stem.activation_bytes,
  )
  assert stem.training_bytes == 8 * stem.activation_bytes
  # A plain function: one BN assumed after each conv, on its output.
  fn_traffic = flops.batchnorm_traffic(
    single_conv_fn((2, 2), "SAME", 1), (2, 8, 8, 3), params={"w": jnp.ones((3, 3, 3, 5))}
  )
  assert [t.activation_shape for t in fn_traffic] == [(2, 4, 4, 5)]


def test_layer_flops_and_batchnorm_traffic_equal_the_separate_calls(tiny_resnet, single_conv_fn):
  model = tiny_resnet
  layers, traffic = flops.layer_flops_and_batchnorm_traffic(model, (2, 8, 8, 3))
  assert layers == flops.layer_flops(model, (2, 8, 8, 3))
  assert traffic == flops.batchnorm_traffic(model, (2, 8, 8, 3))
  fn, params = single_conv_fn((2, 2), "SAME", 1), {"w": jnp.ones((3, 3, 3, 5))}
  fn_layers, fn_traffic = flops.layer_flops_and_batchnorm_traffic(fn, (2, 8, 8, 3), params=params)
  assert fn_layers == flops.layer_flops(fn, (2, 8, 8, 3), params=params)
  assert fn_traffic == flops.batchnorm_traffic(fn, (2, 8, 8, 3), params=params)
  with pytest.raises(ValueError, match="input_shape"):
    flops.layer_flops_and_batchnorm_traffic(model, (2, 8, 8))

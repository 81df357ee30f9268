"""Tests for jaxprune.flops._trace: layers and parameter paths found through wrappers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprune import flops


def test_paths_found_through_jit_custom_vjp_mask_and_dtype_cast(conv):
  @jax.custom_vjp
  def custom_conv(x, w):
    return conv(x, w)

  custom_conv.defvjp(
    lambda x, w: (conv(x, w), (x, w)),
    lambda res, g: jax.vjp(conv, *res)[1](g),
  )

  def fn(params, x):
    kernel = (params["block"]["w"] * params["mask"]).astype(jnp.bfloat16).astype(jnp.float32)
    y = jax.jit(custom_conv)(x, kernel)
    y = jax.checkpoint(lambda y, w: conv(jax.nn.relu(y), w))(y, params["second"])
    return y.mean(axis=(1, 2)) @ params["head"].T

  params = {
    "block": {"w": jnp.ones((3, 3, 3, 4))},
    "mask": jnp.ones((3, 3, 3, 4)),
    "second": jnp.ones((3, 3, 4, 4)),
    "head": jnp.ones((2, 4)),
  }
  layers = flops.layer_flops(fn, (1, 6, 6, 3), params=params)
  # The masked kernel multiplies two parameter leaves of the same shape: the first is kept.
  assert [layer.param_path for layer in layers] == [("block", "w"), ("second",), ("head",)]
  assert layers[2].kernel_shape == (4, 2)  # transposed view of the (2, 4) leaf
  assert layers[2].forward == 2 * 4 * 2


def test_scan_over_stacked_layers_multiplies_by_length():
  depth, width, batch = 3, 6, 4

  def fn(params, x):
    def body(h, w):
      return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, x, params["stack"])
    return h

  params = {"stack": jnp.ones((depth, width, width))}
  (layer,) = flops.layer_flops(fn, (batch, width), params=params)
  assert layer.count == depth
  assert layer.param_path == ("stack",)
  assert layer.forward == depth * 2 * batch * width * width
  # A mask keeping one third of the stacked weights keeps one third of the FLOPs in total.
  mask = np.zeros((depth, width, width))
  mask[:, :, :2] = 1
  (masked,) = flops.layer_flops(fn, (batch, width), params=params, masks={"stack": mask})
  assert masked.forward * 3 == layer.forward


def test_pallas_call_body_counts_once_per_grid_step():
  pallas = pytest.importorskip("jax.experimental.pallas")

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] @ w_ref[...]

  def fn(params, x):
    return pallas.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((16, 8), jnp.float32),
      grid=(2,),
      in_specs=[
        pallas.BlockSpec((8, 4), lambda i: (i, 0)),
        pallas.BlockSpec((4, 8), lambda i: (0, 0)),
      ],
      out_specs=pallas.BlockSpec((8, 8), lambda i: (i, 0)),
      interpret=True,
    )(x, params["w"])

  (layer,) = flops.layer_flops(fn, (16, 4), params={"w": jnp.ones((4, 8))})
  assert layer.count == 2
  assert layer.forward == 2 * 16 * 4 * 8  # two 8-row blocks of the 16×4 @ 4×8 product
  assert layer.param_path == ("w",)  # the block is the whole weight


def test_activation_matmul_is_reported_without_weight():
  def fn(params, x):
    q = x @ params["wq"]
    return jnp.einsum("btd,bsd->bts", q, q)

  params = {"wq": jnp.ones((4, 4))}
  dense, matmul = flops.layer_flops(fn, (2, 5, 4), params=params)
  assert dense.kind == "dense" and dense.param_path == ("wq",)
  assert matmul.kind == "matmul" and matmul.param_path is None
  assert matmul.forward == 2 * 2 * 5 * 5 * 4
  assert matmul.backward_weight == 0
  assert matmul.backward_data == 2 * matmul.forward  # gradient to both operands

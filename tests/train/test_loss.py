"""Class ids outside the logits' range are rejected, never counted as a zero loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprune.train.loss import cross_entropy, cross_entropy_per_example


@pytest.mark.parametrize("bad", [12, 10, -1])
def test_out_of_range_label_raises_eagerly(bad):
  with pytest.raises(ValueError, match="labels"):
    cross_entropy_per_example(jnp.zeros((2, 10)), jnp.array([3, bad]))
  with pytest.raises(ValueError, match="labels"):
    cross_entropy(jnp.zeros((2, 10)), jnp.array([3, bad]))


def test_out_of_range_label_under_jit_gives_nan_row_not_zero():
  loss = jax.jit(cross_entropy_per_example)(jnp.zeros((3, 10)), jnp.array([3, 12, -1]))
  # Uniform logits: the valid row's loss is log(10) by hand.
  np.testing.assert_allclose(loss[0], np.log(10.0), rtol=1e-6)
  assert np.isnan(loss[1]) and np.isnan(loss[2])
  assert np.isnan(jax.jit(cross_entropy)(jnp.zeros((2, 10)), jnp.array([3, 12])))

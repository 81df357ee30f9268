"""The convolution argument checks shared by the pattern-sparse and SDGP convolutions."""

import numpy as np
import pytest

from jaxprune._conv_args import canonical_padding, spatial_pair


def test_spatial_pair_takes_an_int_a_pair_or_numpy_ints():
  assert spatial_pair(2, "strides") == (2, 2)
  assert spatial_pair((1, 3), "strides") == (1, 3)
  assert spatial_pair([np.int64(2), np.int32(1)], "rhs_dilation") == (2, 1)


@pytest.mark.parametrize("bad", [0, (1, 0), (1, 2, 3), 1.5, (1.0, 2), "2"])
def test_spatial_pair_rejects_anything_else_naming_the_argument(bad):
  with pytest.raises(ValueError, match="lhs_dilation"):
    spatial_pair(bad, "lhs_dilation")


def test_canonical_padding_forms():
  assert canonical_padding("same") == "SAME"
  assert canonical_padding(1) == ((1, 1), (1, 1))
  assert canonical_padding([2, (0, 1)]) == ((2, 2), (0, 1))
  assert canonical_padding("same_lower", ("SAME", "VALID", "SAME_LOWER")) == "SAME_LOWER"


@pytest.mark.parametrize("bad", ["same_lower", "CIRCULAR", (1, 1, 1), ((1, -1), (0, 0)), 1.5])
def test_canonical_padding_rejects_unsupported_forms(bad):
  with pytest.raises(ValueError, match="padding"):
    canonical_padding(bad)

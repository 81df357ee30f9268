"""The pattern_conv benchmark: a one-layer run."""

import json
import math

import numpy as np

from experiments.clicktrain import pattern_conv_bench as bench
from jaxprune.clicktrain import patterns


def test_one_layer_run_writes_the_table(tmp_path):
  result = bench.main(
    [
      "--models",
      "vgg11",
      "--width",
      "0.0625",
      "--batch",
      "1",
      "--repeats",
      "1",
      "--layers",
      "1",
      "--out",
      str(tmp_path),
    ]
  )
  (row,) = result["models"]["clicktrain-vgg11"]
  assert row["layer"] == "features/1/conv" and 0.6 < row["sparsity"] < 0.9
  assert all(
    row[k] > 0 for k in ("dense_fwd_ms", "sparse_fwd_ms", "convert_ms", "bcsr_fromdense_ms")
  )
  assert json.loads((tmp_path / "pattern_conv_bench.json").read_text())["backend"] == "reference"
  assert "features/1/conv" in (tmp_path / "pattern_conv_bench.md").read_text()

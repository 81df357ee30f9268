"""The pattern_conv benchmark's masks and a one-layer run."""

import json
import math

import numpy as np

from experiments import pattern_conv_bench as bench
from jaxprune.clicktrain import patterns


def test_clicktrain_like_masks_match_the_ratio_and_the_library():
  rng = np.random.default_rng(0)
  library = {p.tobytes() for p in patterns.library_patterns().astype(np.float32)}
  for balanced in (False, True):
    mask = bench.clicktrain_like_mask((3, 3, 12, 10), 0.65, rng, balanced=balanced)
    kept = mask.sum((0, 1)) > 0  # (Cin, Cout)
    if balanced:
      assert (kept.sum(0) == 12 - math.ceil(0.65 * 12)).all()
    else:
      assert kept.sum() == 120 - math.ceil(0.65 * 120)
    for c, f in zip(*np.nonzero(kept)):
      assert mask[:, :, c, f].tobytes() in library
  one_by_one = bench.clicktrain_like_mask((1, 1, 8, 8), 0.5, rng)
  assert one_by_one.sum() == 32


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

"""The 1x1 weight-gradient benchmark: its baseline really is lax's convolution, and a tiny
run writes the table."""

import json

from flax import nnx
from jax import lax

from experiments.benchmarks import conv_weight_grad as bench
from jaxprune.models.conv import conv_general_dilated


def test_baseline_model_uses_lax_and_the_other_the_library_conv():
  def conv_functions(model):
    return {m.conv_general_dilated for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Conv)}

  assert conv_functions(bench._model("prunetrain-resnet50", 0.125, True)) == {
    lax.conv_general_dilated
  }
  assert conv_functions(bench._model("prunetrain-resnet50", 0.125, False)) == {conv_general_dilated}


def test_tiny_run_writes_the_table(tmp_path):
  args = ["--models", "prunetrain-resnet20", "--width", "0.125", "--batch", "2"]
  args += ["--steps", "1", "--repeats", "1", "--out", str(tmp_path)]
  (row,) = bench.main(args)
  assert row["model"] == "prunetrain-resnet20" and row["mflops_per_image"] > 0
  assert all(row[f"{variant} ms"] > 0 for variant in bench.VARIANTS) and row["speedup"] > 0
  saved = json.loads((tmp_path / "conv_weight_grad.json").read_text())
  assert saved["rows"][0]["model"] == "prunetrain-resnet20"
  assert "| prunetrain-resnet20 |" in (tmp_path / "conv_weight_grad.md").read_text()

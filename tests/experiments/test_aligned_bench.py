"""aligned_bench runs end to end on a tiny setting and reports ratios of its own timings."""

import json

import pytest

from experiments import aligned_bench


def test_aligned_bench_tiny_run_writes_tables(tmp_path):
  # G = 2 alone: its per-group and shared-column rows; G = 1's rows are the same code with one
  # group (and the layer rows time G = 1 without the gather in any case).
  argv = "--small --width 0.125 --batch 2 --repeats 1 --models vgg11 --groups 2 --measured"
  argv += f" --dtypes fp32 --no-imagenet --layers 2 --out {tmp_path}"
  result = aligned_bench.main(argv.split())
  steps = result["steps"]
  assert [s["variant"] for s in steps] == ["dense", "aligned G=2", "aligned G=2 shared"]
  assert all(s["dense_ms"] == steps[0]["ms"] > 0 for s in steps)  # ratios use this run's dense
  assert all(s["compression"] > 2.25 for s in steps)  # 9/4 from the patterns alone, then kernels
  assert len(result["layers"]) == 2
  for row in result["layers"]:
    assert {"dense", "aligned G=2", "aligned G=2 shared", "G=1 no gather"} <= set(row["ms"])
  saved = json.loads((tmp_path / "aligned_bench_cpu_small.json").read_text())
  assert saved["steps"] == steps
  page = (tmp_path / "aligned_bench_cpu_small.md").read_text()
  ratio = steps[1]["ms"] / steps[0]["ms"]
  assert f"{ratio:.2f}×" in page


def test_step_rows_follow_dtypes_with_the_same_masks_and_the_fp32_rows_unchanged(
  tmp_path, monkeypatch
):
  """``--dtypes`` reaches the whole-step rows: each dtype's rows are labelled and drawn from the
  same masks and batch; the fp32 rows, the layer rows after them and the fp32 page section are
  what an fp32-only run writes. (Timings faked: what is checked is the plumbing.)"""
  draws = []

  def fake_step(name, variant, args, rng, dtype="fp32"):
    draw = int(rng.integers(1 << 30))  # stands for the masks and batch bench_step draws
    draws.append((variant, dtype, draw))
    return 1.0 + draw % 7, 2.0

  def fake_layer(spec, dtype, args, rng):
    return {**spec, "dtype": dtype, "compression": 2.0, "ms": {"dense": 1.0 + rng.random()}}

  monkeypatch.setattr(aligned_bench, "bench_step", fake_step)
  monkeypatch.setattr(aligned_bench, "bench_layer", fake_layer)
  argv = "--small --width 0.125 --models vgg11 --groups 1 --measured --no-imagenet --layers 1"
  fp32 = aligned_bench.main([*argv.split(), "--dtypes", "fp32", "--out", str(tmp_path / "a")])
  both = aligned_bench.main(
    [*argv.split(), "--dtypes", "fp32", "bf16", "--out", str(tmp_path / "b")]
  )
  assert [s for s in both["steps"] if s["dtype"] == "fp32"] == fp32["steps"]
  assert both["layers"][0] == fp32["layers"][0]
  bf16 = [s for s in both["steps"] if s["dtype"] == "bf16"]
  assert [s["variant"] for s in bf16] == ["dense", "aligned G=1"]
  assert [s["ms"] for s in bf16] == [s["ms"] for s in fp32["steps"]]  # the same draws
  one = (tmp_path / "a" / "aligned_bench_cpu_small.md").read_text()
  two = (tmp_path / "b" / "aligned_bench_cpu_small.md").read_text()
  fp32_section = one.split("## Per layer")[0].split("## Whole train step")[1]
  assert fp32_section.startswith(" (forward, backward, SGD), fp32\n")
  assert "## Whole train step" + fp32_section in two
  assert "## Whole train step (forward, backward, SGD), bf16" in two
  assert "bf16" not in one.split("## Per layer")[0]


def test_bench_step_builds_the_model_in_its_dtype(monkeypatch):
  """A bf16 step row times a model computing in bf16, its pruned convs aligned bf16 layers."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from jaxprune.clicktrain.execution.sparse_layers import AlignedConv

  converted = []
  convert = aligned_bench.to_sparse_layers
  monkeypatch.setattr(
    aligned_bench,
    "to_sparse_layers",
    lambda model, *a, **k: converted.append(model) or convert(model, *a, **k),
  )
  monkeypatch.setattr(aligned_bench, "median_call_ms", lambda step, repeats: 1.0)  # no timing
  args = aligned_bench._parse(["--small", "--width", "0.125", "--batch", "2"])
  rng = np.random.default_rng(0)
  _, compression = aligned_bench.bench_step("vgg11", "aligned G=1", args, rng, "bf16")
  assert compression > 2.25
  (model,) = converted
  assert model.dtype == jnp.bfloat16
  aligned = [m for _, m in nnx.iter_modules(model) if isinstance(m, AlignedConv)]
  assert aligned and {m.dtype for m in aligned} == {jnp.dtype(jnp.bfloat16)}


def test_small_fills_only_the_sizes_the_command_line_leaves_out():
  # Before: --small overrode --width/--batch/--repeats given beside it, without a word.
  args = aligned_bench._parse(["--small", "--width", "0.125", "--batch", "2"])
  assert (args.width, args.batch, args.imagenet_batch, args.repeats) == (0.125, 2, 4, 3)
  args = aligned_bench._parse(["--repeats", "5"])
  assert (args.width, args.batch, args.imagenet_batch, args.repeats) == (1.0, 128, 64, 5)


def test_models_take_short_or_full_names_and_refuse_others(capsys):
  assert aligned_bench._parse(["--models", "clicktrain-vgg11", "resnet32"]).models == [
    "vgg11",
    "resnet32",
  ]
  with pytest.raises(SystemExit):
    aligned_bench._parse(["--models", "resnet50"])
  assert "invalid choice: 'resnet50'" in capsys.readouterr().err

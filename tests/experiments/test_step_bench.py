"""step_bench: a tiny run end to end, ratios from its own timings; ClickTrain's steady-state
variants compute the masked dense model's step."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.benchmarks import step_bench
from jaxprune import clicktrain, models
from jaxprune.clicktrain.execution import pattern_convs
from jaxprune.clicktrain.execution.sparse_layers import AlignedConv, PatternConv


def test_tiny_run_writes_a_table_of_ratios_to_its_own_dense_step(tmp_path):
  argv = "--small --width 0.125 --batch 2 --repeats 1 --suites sdgp"
  argv += f" --sdgp-methods magnitude --dtypes bf16 --out {tmp_path}"
  result = step_bench.main(argv.split())
  rows = result["rows"]
  assert [(r["suite"], r["variant"]) for r in rows] == [
    ("sdgp", "dense"),
    ("sdgp", "sdgp 2:4 magnitude (reference)"),
  ]
  assert not result["not_measured"]
  for r in rows:
    assert r["dtype"] == "bf16" and r["ms"] > 0 and r["compile_s"] > 0
    assert r["ratio"] == pytest.approx(r["ms"] / rows[0]["ms"])  # same run's dense step
  assert rows[1]["auto"]  # backend="auto" runs the reference on CPU
  saved = json.loads((tmp_path / "step_time_cpu_small.json").read_text())
  assert saved["rows"] == rows
  page = (tmp_path / "step_time_cpu_small.md").read_text()
  assert f"{rows[1]['ratio']:.2f}×" in page and "JAX " + jax.__version__ in page


def test_prunetrain_variants_are_the_reconfigured_models_with_their_flops(tiny_resnet):
  model = tiny_resnet(in_channels=3)
  batch = (jnp.zeros((2, 8, 8, 3)), jnp.asarray([1, 2]))
  variants = list(step_bench.prunetrain_variants(model, batch, [0.5]))
  assert [label for label, _, _ in variants] == [
    "group lasso, full width",
    "group lasso, reconfigured to 50% channels",
  ]
  (_, full, full_row), (_, half, half_row) = variants
  assert full_row["flops"] == 1.0 and 0 < half_row["flops"] < 0.5  # half the channels: < 1/2
  widths = [x.shape[-1] for x in jax.tree.leaves(full.state[0]) if x.ndim == 4]
  half_widths = [x.shape[-1] for x in jax.tree.leaves(half.state[0]) if x.ndim == 4]
  assert sum(half_widths) == sum(max(1, round(w / 2)) for w in widths)


def test_spent_time_budget_leaves_a_table_listing_what_was_not_measured(tmp_path):
  argv = f"--small --suites sdgp imagenet --dtypes fp32 bf16 --max-seconds 0 --out {tmp_path}"
  result = step_bench.main(argv.split())
  assert result["rows"] == []
  assert len(result["not_measured"]) == 4
  assert "sdgp bf16" in (tmp_path / "step_time_cpu_small.md").read_text()


@pytest.mark.parametrize("argv", ["--keep 1.0", "--groups 0", "--repeats 0"])
def test_bad_arguments_are_refused(argv, tmp_path):
  with pytest.raises(SystemExit):
    step_bench.main([*argv.split(), "--out", str(tmp_path)])


def _params_after_one_step(stepper):
  stepper.step()
  return jax.tree.map(np.asarray, stepper.state[0])


# Slow (half a minute): the variants' construction runs in the bf16 test below, and the layers
# they time compute the masked model's function and gradients in
# tests/clicktrain/test_sparse_execution.py.
@pytest.mark.slow
def test_clicktrain_variants_step_like_the_masked_dense_model():
  model = models.ResNet(
    models.prunetrain_resnet_spec(8).scaled(0.5), num_classes=10, rngs=nnx.Rngs(0)
  )
  rng = np.random.default_rng(0)
  batch = (jnp.asarray(rng.normal(size=(2, 8, 8, 3)), jnp.float32), jnp.asarray([1, 7]))
  variants = list(step_bench.clicktrain_variants(model, batch, [2]))
  labels = [label for label, _, _ in variants]
  assert labels == [
    "masked dense",
    "fine-grained (reference)",
    "measured dispatch",
    "aligned G=2",
    "aligned G=2, SGD + masks",
    "aligned G=2 shared",
  ]
  assert all(row["compression"] > 9 / 4 for _, _, row in variants)  # patterns, then kernels
  # The transform's aligned row and its SGD + masks pair are timed together (time_pair).
  assert variants[4][2]["versus"] == "aligned G=2" and "versus" not in variants[3][2]
  assert variants[3][2]["timed_with_next"] and "timed_with_next" not in variants[5][2]
  steppers = {label: stepper for label, stepper, _ in variants}
  fine = nnx.merge(
    steppers["fine-grained (reference)"].graphdef, *steppers["masked dense"].state[:2]
  )
  layers = pattern_convs(fine).values()
  assert layers and all(isinstance(m, PatternConv) for m in layers)
  for label, columns in (("aligned G=2", "per_group"), ("aligned G=2 shared", "shared")):
    aligned = nnx.merge(steppers[label].graphdef, *steppers[label].state[:2])
    layers = pattern_convs(aligned).values()
    assert layers and all(isinstance(m, AlignedConv) and m.columns == columns for m in layers)
  # Fine-grained and measured dispatch run the same function as the masked dense model, from
  # the same pruned state: one step lands on the same parameters.
  want = _params_after_one_step(steppers["masked dense"])
  for label in ("fine-grained (reference)", "measured dispatch"):
    got = _params_after_one_step(steppers[label])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got, want)
  # (That the two column layouts compute the same function is aligned_conv's own test.)
  # The reference row for the transform's cost: the same aligned layers under the inner
  # optimizer and the final masks keep the pruned weights at exactly zero.
  plain = steppers["aligned G=2, SGD + masks"]
  # The ClickTrain rows run the step specialised to the pruned stage, as a trainer would.
  assert clicktrain.is_specialized(steppers["aligned G=2"].state[2])
  pair = step_bench.time_pair(steppers["aligned G=2"], plain, repeats=1)
  assert len(pair) == 2 and min(pair) > 0
  masks = clicktrain.masks(steppers["aligned G=2"].state[2], steppers["aligned G=2"].state[0])
  flat_masks = jax.tree.leaves(masks, is_leaf=lambda v: v is None)
  flat_params = jax.tree.leaves(_params_after_one_step(plain))
  pruned = 0
  for w, m in zip(flat_params, flat_masks, strict=True):
    if m is not None:
      assert np.all(w[np.asarray(m) == 0] == 0)
      pruned += int((np.asarray(m) == 0).sum())
  assert pruned > 0


def test_clicktrain_variants_keep_the_models_dtype():
  """A bf16 row times a model computing in bf16, its pruned convs aligned bf16 layers."""
  model = models.create(
    "clicktrain-vgg11",
    num_classes=10,
    rngs=nnx.Rngs(0),
    width_multiplier=0.0625,
    dtype=jnp.bfloat16,
  )
  batch = (jnp.zeros((2, 32, 32, 3)), jnp.asarray([1, 7]))
  (label, stepper, row), (plain_label, _, _) = step_bench.clicktrain_variants(
    model, batch, [1], model_name="clicktrain-vgg11", dispatch=False
  )
  assert label == "aligned G=1" and row["compression"] > 2.25
  assert plain_label == "aligned G=1, SGD + masks"
  aligned = pattern_convs(nnx.merge(stepper.graphdef, *stepper.state[:2])).values()
  assert len(aligned) == 7 and {m.dtype for m in aligned} == {jnp.dtype(jnp.bfloat16)}

"""Per-layer sparse execution: conversion, dispatch, training equality and resume."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain, train
from jaxprune.clicktrain import patterns
from jaxprune.clicktrain.execution import (
  PatternConv,
  SparseExecution,
  format_report,
  pattern_convs,
  to_sparse_layers,
)


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.stem = nnx.Conv(1, 8, (3, 3), use_bias=False, rngs=rngs)
    self.conv1 = nnx.Conv(8, 8, (3, 3), use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 12, (3, 3), strides=2, padding="VALID", use_bias=True, rngs=rngs)
    self.conv3 = nnx.Conv(12, 8, (1, 1), use_bias=False, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    x = nnx.relu(self.bn(self.conv1(x)))
    x = nnx.relu(self.conv2(x))
    x = nnx.relu(self.conv3(x))
    return self.head(x.mean((1, 2)))


def _pattern_mask(rng, shape, keep):
  kh, kw, cin, cout = shape
  if kh == kw == 1:
    return (rng.random((1, 1, cin, cout)) < keep).astype(np.float32)
  pats = patterns.all_patterns(4, 3)
  mask = np.transpose(pats[rng.integers(0, len(pats), (cin, cout))], (2, 3, 0, 1))
  return (mask * (rng.random((cin, cout)) < keep)[None, None]).astype(np.float32)


def _masks(model, seed=0, keep=0.5):
  rng = np.random.default_rng(seed)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  masks = jax.tree.map(lambda _: None, params)
  for name in ("conv1", "conv2", "conv3"):
    masks[name]["kernel"] = _pattern_mask(rng, params[name]["kernel"].shape, keep)
  return masks


def _apply(model, masks):
  for name in ("conv1", "conv2", "conv3"):
    conv = getattr(model, name)
    conv.kernel[...] = conv.kernel[...] * masks[name]["kernel"]


def test_converted_model_computes_the_masked_model_and_its_gradients():
  model = _Net(nnx.Rngs(0))
  masks = _masks(model)
  _apply(model, masks)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 9, 9, 1)), jnp.float32)
  y = jnp.arange(2) % 3

  def loss_grads(m):
    def loss(m):
      return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    return nnx.value_and_grad(loss)(m)

  loss0, grads0 = loss_grads(model)
  params_before = jax.tree.structure(nnx.as_pure(nnx.state(model, nnx.Param)))
  converted, choices = to_sparse_layers(model, masks, threshold=0.0, backend="reference")
  assert converted is model
  assert sorted(pattern_convs(model)) == ["conv1", "conv2", "conv3"]
  assert {c.path: c.backend for c in choices} == dict.fromkeys(
    ["conv1", "conv2", "conv3"], "reference"
  )
  assert model.conv1.kernel is not None and isinstance(model.conv2, PatternConv)
  loss1, grads1 = loss_grads(model)
  np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
  # The sparse path's kernel gradient is the dense one at kept positions, zero elsewhere.
  grads0, grads1 = nnx.as_pure(grads0), nnx.as_pure(grads1)
  for name in ("conv1", "conv2", "conv3"):
    grads0[name]["kernel"] = grads0[name]["kernel"] * masks[name]["kernel"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads1, grads0)
  # Same parameter tree: the optimizer state of the dense model fits the converted one.
  assert jax.tree.structure(nnx.as_pure(nnx.state(model, nnx.Param))) == params_before
  assert "conv2" in format_report(choices)


def test_threshold_decides_per_layer_once():
  model = _Net(nnx.Rngs(0))
  masks = _masks(model, keep=0.5)
  masks["conv1"]["kernel"] = _pattern_mask(np.random.default_rng(3), (3, 3, 8, 8), keep=1.0)
  # conv1 keeps 4/9 of every kernel (55.6% sparse); conv2 about 78%; conv3 (1x1) about 50%.
  _, choices = to_sparse_layers(model, masks, threshold=0.65, backend="reference")
  by_path = {c.path: c for c in choices}
  assert by_path["conv1"].backend == "dense" and abs(by_path["conv1"].sparsity - 5 / 9) < 1e-9
  assert by_path["conv2"].backend == "reference" and by_path["conv2"].sparsity > 0.65
  assert not isinstance(model.conv1, PatternConv) and isinstance(model.conv2, PatternConv)
  expected = 1 - masks["conv3"]["kernel"].mean()
  assert by_path["conv3"].backend == ("reference" if expected > 0.65 else "dense")


def test_convert_rejects_bad_masks_and_arguments():
  model = _Net(nnx.Rngs(0))
  masks = _masks(model)
  bad = jax.tree.map(lambda m: m, masks, is_leaf=lambda m: m is None)
  k = np.array(bad["conv1"]["kernel"])
  c, f = np.argwhere(k.sum((0, 1)) == 4)[0]
  k[:, :, c, f] = 0
  k[:2, :2, c, f] = 1
  k[2, 2, c, f] = 1  # 5 non-zeros
  bad["conv1"]["kernel"] = k
  with pytest.raises(ValueError, match=r"conv1: .*keeps 5 weights"):
    to_sparse_layers(_Net(nnx.Rngs(0)), bad, threshold=0.0)
  wrong_shape = dict(masks, conv1={"kernel": np.ones((3, 3, 8, 9))})
  with pytest.raises(ValueError, match="conv1 has shape"):
    to_sparse_layers(_Net(nnx.Rngs(0)), wrong_shape, threshold=0.0)
  with pytest.raises(ValueError, match="threshold"):
    to_sparse_layers(_Net(nnx.Rngs(0)), masks, threshold=float("nan"))
  with pytest.raises(ValueError, match="backend"):
    to_sparse_layers(_Net(nnx.Rngs(0)), masks, backend="cusparse")
  to_sparse_layers(model, masks, threshold=0.0)
  with pytest.raises(ValueError, match="already a PatternConv"):
    to_sparse_layers(model, masks, threshold=0.0)


class _Loader:
  def __init__(self, images, labels, batch_size):
    self.images, self.labels, self.batch_size, self.epoch = images, labels, batch_size, 0

  def set_epoch(self, epoch):
    self.epoch = epoch

  def __len__(self):
    return len(self.images) // self.batch_size

  def __iter__(self):
    order = np.random.default_rng(self.epoch).permutation(len(self.images))
    for i in range(len(self)):
      idx = order[i * self.batch_size : (i + 1) * self.batch_size]
      yield self.images[idx], self.labels[idx]


def _run(tmp_path=None, *, sparse=True, epochs=5):
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 3, 32).astype(np.int32)
  images = rng.normal(size=(32, 9, 9, 1)).astype(np.float32)
  images[:, :3, :3, 0] += labels[:, None, None]
  loader = _Loader(images, labels, 8)
  tx = clicktrain.clicktrain(
    optax.sgd(0.05, momentum=0.9),
    steps_per_epoch=len(loader),
    mode="one_shot",
    one_shot_epoch=1,
    hard_prune_epoch=2,
    kernel_prune_ratio=0.5,
  )
  hooks = [SparseExecution(threshold=0.0, backend="reference")] if sparse else []
  trainer = train.Trainer(
    _Net(nnx.Rngs(0)),
    tx,
    callbacks=hooks,
    checkpoint_dir=None if tmp_path is None else tmp_path / "ckpt",
  )
  history = trainer.fit(loader, epochs=epochs)
  return trainer, history


@pytest.fixture(scope="module")
def sparse_run():
  return _run(sparse=True)


def test_training_after_the_switch_matches_the_masked_dense_model(sparse_run):
  sparse, h_sparse = sparse_run
  dense, h_dense = _run(sparse=False)
  # Converted at the epoch end where the stage becomes "pruned": the weights are zero there.
  assert [r["sparse_layers"] for r in h_sparse] == [0, 3, 3, 3, 3]
  assert sorted(pattern_convs(sparse.model)) == ["conv1", "conv2", "conv3"]
  assert not pattern_convs(dense.model)
  for a, b in zip(h_sparse, h_dense):
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-4)
  params_s = nnx.state(sparse.model, nnx.Param)
  params_d = nnx.state(dense.model, nnx.Param)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5), params_s, params_d
  )
  weight_masks = clicktrain.masks(sparse.opt_state, nnx.as_pure(params_s))
  kernel = np.asarray(sparse.model.conv2.kernel[...])
  assert np.all(kernel[np.asarray(weight_masks["conv2"]["kernel"]) == 0] == 0)


def test_resume_across_the_switch_is_exact(tmp_path, sparse_run):
  straight, h_straight = sparse_run
  _run(tmp_path, epochs=4)  # converted at the end of epoch 2, checkpoint after epoch 4
  resumed, h_resumed = _run(tmp_path, epochs=5)  # converts again when the fit starts
  assert sorted(pattern_convs(resumed.model)) == ["conv1", "conv2", "conv3"]
  assert [r["train_loss"] for r in h_resumed] == [r["train_loss"] for r in h_straight]
  jax.tree.map(
    np.testing.assert_array_equal,
    nnx.state(resumed.model, nnx.Param),
    nnx.state(straight.model, nnx.Param),
  )


@pytest.mark.parametrize("method", ["magnitude", "mvue"])
def test_sparse_path_composes_with_sdgp(method):
  # An SDGP model switched to the sparse path keeps SDGP's backward pass: the same loss and
  # gradients (the kernel gradients at kept positions) as the SDGP model with masked weights,
  # the N:M-pruned output gradient flowing into the sparse data-gradient path; for the random
  # method the layers keep their key Variables, so both draw the same masks.
  from jaxprune import sdgp

  model = _Net(nnx.Rngs(0))
  masks = _masks(model)
  _apply(model, masks)
  sdgp.convert_model(model, n=2, m=4, method=method, seed=3)
  assert isinstance(model.conv1, sdgp.SDGPConv)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 9, 9, 1)), jnp.float32)
  y = jnp.arange(2) % 3

  def loss_grads(m):
    def loss(m, x):
      return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    keys = nnx.as_pure(nnx.state(m, sdgp.SDGPKey))  # a snapshot: the call advances them
    out = nnx.value_and_grad(loss, argnums=(0, 1))(m, x)
    nnx.update(m, keys)  # the same key stream for both runs
    return out

  loss0, (grads0, dx0) = loss_grads(model)
  keys_before = jax.tree.leaves(nnx.state(model, sdgp.SDGPKey))
  to_sparse_layers(model, masks, threshold=0.0, backend="reference")
  assert isinstance(model.conv1, PatternConv)
  assert model.conv1.conv_general_dilated.settings.method == method  # SDGP's wrapper kept
  assert len(jax.tree.leaves(nnx.state(model, sdgp.SDGPKey))) == len(keys_before)
  loss1, (grads1, dx1) = loss_grads(model)
  np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
  np.testing.assert_allclose(dx1, dx0, rtol=1e-4, atol=1e-6)
  grads0, grads1 = nnx.as_pure(grads0), nnx.as_pure(grads1)
  for name in ("conv1", "conv2", "conv3"):
    grads0[name]["kernel"] = grads0[name]["kernel"] * masks[name]["kernel"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads1, grads0)
  # The data gradient really is pruned: it differs from the dense model's.
  dense = _Net(nnx.Rngs(0))
  _apply(dense, masks)
  _, (_, dx_dense) = loss_grads(dense)
  assert not np.allclose(dx1, dx_dense, atol=1e-6)


def test_measured_dispatch_keeps_the_faster_path_per_layer(monkeypatch):
  from jaxprune.clicktrain.execution import build_layout, conversion
  from jaxprune.clicktrain.execution.layer_timing import time_layer

  # The timing itself (real calls on this machine): every entry is a positive duration.
  model = _Net(nnx.Rngs(0))
  masks = _masks(model)
  layout = build_layout(masks["conv2"]["kernel"])
  times = time_layer(layout, (1, 9, 9, 8), strides=2, padding="VALID", repeats=1)
  assert set(times) == {f"{p}_{d}_ms" for p in ("dense", "sparse") for d in ("fwd", "dx", "dw")}
  assert all(t > 0 for t in times.values())

  # The decision, with planted timings: sparse only where it is faster (forward + backward),
  # each layer timed at its own traced input shape.
  seen = {}

  calls = []

  def fake_time_train_pass(conv, input_shape, kernel, *, repeats):
    # Called dense first, then sparse, per layer.
    seen[tuple(kernel.shape)] = tuple(input_shape)
    calls.append(kernel.shape)
    sparse_faster = kernel.shape[-1] == 12  # conv2 only
    is_sparse = calls.count(kernel.shape) == 2
    dense, sparse = (9.0, 3.0) if sparse_faster else (3.0, 9.0)
    return sparse if is_sparse else dense

  monkeypatch.setattr(conversion, "time_train_pass", fake_time_train_pass)
  _apply(model, masks)
  _, choices = to_sparse_layers(
    model, masks, threshold="measure", input_shape=(2, 9, 9, 1), check_model=False
  )
  assert choices.model_ms == {} and choices.kept is None
  by_path = {c.path: c for c in choices}
  assert {p: c.backend != "dense" for p, c in by_path.items()} == {
    "conv1": False,
    "conv2": True,
    "conv3": False,
  }
  assert by_path["conv2"].dense_ms == 9.0 and by_path["conv2"].sparse_ms == 3.0
  assert seen[(3, 3, 8, 8)] == (2, 9, 9, 8) and seen[(1, 1, 12, 8)] == (2, 4, 4, 12)
  assert sorted(pattern_convs(model)) == ["conv2"]
  assert "9.00 / 3.00" in format_report(choices)
  with pytest.raises(ValueError, match="input_shape"):
    to_sparse_layers(_Net(nnx.Rngs(0)), masks, threshold="measure")
  with pytest.raises(ValueError, match="threshold"):
    to_sparse_layers(_Net(nnx.Rngs(0)), masks, threshold="fastest", input_shape=(1, 9, 9, 1))
  assert to_sparse_layers(_Net(nnx.Rngs(0)), masks, threshold="fixed")[1][0].backend == "dense"


def _sparse_paths(model):
  return tuple(sorted(pattern_convs(model)))


@pytest.mark.parametrize(
  "fastest, sparse",
  [("per-layer", ("conv2",)), ("dense", ()), ("all sparse", ("conv1", "conv2", "conv3"))],
)
def test_whole_model_check_keeps_the_fastest_of_dense_per_layer_and_all_sparse(
  monkeypatch, fastest, sparse
):
  # conv2 alone measures faster sparse; the whole model is then timed the three ways, each
  # on a copy (the model is switched only once, to the winner), and the fastest kept.
  from jaxprune.clicktrain.execution import conversion

  def per_layer(conv, input_shape, kernel, *, repeats):
    per_layer.calls.append(kernel.shape)
    is_sparse = per_layer.calls.count(kernel.shape) == 2
    return 1.0 if is_sparse == (kernel.shape[-1] == 12) else 2.0

  per_layer.calls = []
  labels = {(): "dense", ("conv2",): "per-layer", ("conv1", "conv2", "conv3"): "all sparse"}
  timed = []

  def whole(model, input_shape, *, repeats):
    label = labels[_sparse_paths(model)]
    timed.append((label, tuple(input_shape)))
    return 1.0 if label == fastest else 5.0

  monkeypatch.setattr(conversion, "time_train_pass", per_layer)
  monkeypatch.setattr(conversion, "time_model_pass", whole)
  model = _Net(nnx.Rngs(0))
  masks = _masks(model)
  _apply(model, masks)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 9, 9, 1)), jnp.float32)
  before = model(x)
  model, report = to_sparse_layers(model, masks, input_shape=(2, 9, 9, 1))
  assert sorted(timed) == sorted((label, (2, 9, 9, 1)) for label in labels.values())
  assert report.kept == fastest
  assert report.model_ms == {label: 1.0 if label == fastest else 5.0 for label in labels.values()}
  assert _sparse_paths(model) == sparse
  # Each choice says where it runs, and which layer-level pick the check overruled.
  for c in report:
    assert c.backend == ("reference" if c.path in sparse else "dense")
    own = "reference" if c.path == "conv2" else "dense"
    assert c.layer_backend == (None if own == c.backend else own)
  assert f"kept: {fastest}." in format_report(report)
  np.testing.assert_allclose(model(x), before, rtol=1e-5, atol=1e-6)


def test_whole_model_check_leaves_a_conv_no_sparse_layer_can_run_out_of_all_sparse(monkeypatch):
  # conv3 dilated (a 1x1 kernel: the same function): no sparse layer runs it, so the
  # "all sparse" candidate switches the other two, and the check does not raise.
  from jaxprune.clicktrain.execution import conversion

  def per_layer(conv, input_shape, kernel, *, repeats):
    per_layer.calls.append(kernel.shape)
    is_sparse = per_layer.calls.count(kernel.shape) == 2
    return 1.0 if is_sparse == (kernel.shape[-1] == 12) else 2.0

  per_layer.calls = []
  timed = []

  def whole(model, input_shape, *, repeats):
    timed.append(_sparse_paths(model))
    return 1.0 if len(timed[-1]) == 2 else 5.0

  monkeypatch.setattr(conversion, "time_train_pass", per_layer)
  monkeypatch.setattr(conversion, "time_model_pass", whole)
  model = _Net(nnx.Rngs(0))
  model.conv3.kernel_dilation = (2, 2)
  masks = _masks(model)
  model, report = to_sparse_layers(model, masks, input_shape=(2, 9, 9, 1))
  assert sorted(timed) == [(), ("conv1", "conv2"), ("conv2",)]
  assert report.kept == "all sparse" and _sparse_paths(model) == ("conv1", "conv2")


def test_whole_model_check_is_skipped_when_no_layer_goes_sparse_and_needs_measuring(monkeypatch):
  from jaxprune.clicktrain.execution import conversion

  monkeypatch.setattr(conversion, "time_train_pass", lambda *a, repeats: 1.0)  # a tie
  monkeypatch.setattr(conversion, "time_model_pass", lambda *a, **k: pytest.fail("timed"))
  model = _Net(nnx.Rngs(0))
  masks = _masks(model)
  _, report = to_sparse_layers(model, masks, input_shape=(2, 9, 9, 1))
  assert [c.backend for c in report] == ["dense"] * 3 and report.kept is None
  for threshold in (0.5, "fixed"):
    with pytest.raises(ValueError, match="check_model"):
      to_sparse_layers(_Net(nnx.Rngs(0)), masks, threshold=threshold, check_model=True)
  with pytest.raises(ValueError, match="check_model"):
    SparseExecution(threshold=0.5, check_model=True)


def test_time_model_pass_times_a_real_pass_and_leaves_the_model_alone():
  model = _Net(nnx.Rngs(0))
  state = jax.tree.map(np.asarray, nnx.state(model))
  from jaxprune.clicktrain.execution.layer_timing import time_model_pass

  assert time_model_pass(model, (2, 9, 9, 1), repeats=1) > 0
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model), state)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_default_dispatch_measures_and_keeps_dense_where_dense_is_faster(monkeypatch, platform):
  # No sparse path is known to win on any platform: the default (no threshold) times every
  # layer, with the platform forced, and a layer whose dense conv is faster stays dense.
  from jaxprune.clicktrain.execution import conversion, options

  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  assert options.default_threshold() == "measure"
  calls = []

  def dense_faster(conv, input_shape, kernel, *, repeats):
    calls.append(tuple(kernel.shape))
    return 5.0 if calls.count(tuple(kernel.shape)) == 2 else 1.0  # sparse timed second

  monkeypatch.setattr(conversion, "time_train_pass", dense_faster)
  model = _Net(nnx.Rngs(0))
  masks = _masks(model)
  _, choices = to_sparse_layers(model, masks, input_shape=(2, 9, 9, 1))
  assert [c.backend for c in choices] == ["dense"] * 3
  assert all(c.dense_ms == 1.0 and c.sparse_ms == 5.0 for c in choices)
  assert not pattern_convs(model)
  assert len(calls) == 6  # each layer timed both ways, once


def test_default_backend_is_the_reference_without_the_triton_backend(monkeypatch):
  # The Pallas kernels are the GPU default only while this JAX has Pallas's Triton backend; a
  # JAX without it gets the reference, and asking for "pallas" says why it cannot.
  import pallas_kernels
  from jaxprune.clicktrain.execution import build_layout
  from jaxprune.clicktrain.execution.options import default_backend

  monkeypatch.setattr(pallas_kernels, "triton_available", lambda: True)
  assert default_backend("gpu") == "pallas"
  assert default_backend("cpu") == "reference"
  monkeypatch.setattr(pallas_kernels, "triton_available", lambda: False)
  assert default_backend("gpu") == "reference"
  model = _Net(nnx.Rngs(0))
  masks = _masks(model)
  unavailable = r"^backend='pallas': the Pallas Triton backend .* unavailable"
  with pytest.raises(ValueError, match=unavailable):
    to_sparse_layers(model, masks, threshold=0.0, backend="pallas")
  with pytest.raises(ValueError, match=unavailable):
    SparseExecution(backend="pallas")
  with pytest.raises(ValueError, match=unavailable):
    layout = build_layout(np.asarray(masks["conv1"]["kernel"]))
    PatternConv.from_conv(model.conv1, layout, backend="pallas")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  _, choices = to_sparse_layers(model, masks, threshold=0.0)
  assert [c.backend for c in choices] == ["reference"] * 3
  assert {m.backend for m in pattern_convs(model).values()} == {"reference"}


@pytest.mark.parametrize(
  ("option", "value", "message"),
  [
    ("filter_groups", "from-state", "filter_groups must be None, 'auto' or 'from_state'"),
    ("filter_groups", 0, "filter_groups must be a positive group count"),
    ("filter_groups", [[0, 1], [-1]], "filter_groups: groups must be"),
    ("threshold", "measured", "threshold must be a sparsity in"),
    ("threshold", 1.5, r"threshold must be a sparsity in \[0, 1\], got 1.5"),
    ("threshold", -0.1, "threshold must be a sparsity in"),
    ("threshold", float("nan"), "threshold must be a sparsity in"),
    ("threshold", True, "threshold must be a sparsity in"),
    ("repeats", 0, "repeats must be a positive int, got 0"),
    ("repeats", 2.5, "repeats must be a positive int"),
    ("nnz_per_kernel", 0, "nnz_per_kernel must be a positive int"),
    ("input_shape", (2, 0, 9, 1), "input_shape must be a sequence of positive ints"),
    ("input_shape", 5, "input_shape must be a sequence of positive ints"),
    ("backend", "cusparse", "backend must be one of"),
    ("check_model", "yes", "check_model must be True, False or None"),
    ("columns", "both", "columns must be one of"),
  ],
)
def test_sparse_execution_checks_every_option_when_built(option, value, message):
  # Built, not converted: no model, no training, no hard prune is needed to see the error.
  with pytest.raises(ValueError, match=message):
    SparseExecution(**{option: value})
  model = _Net(nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    to_sparse_layers(model, _masks(model), **{option: value})


def test_sparse_execution_accepts_the_documented_options():
  for threshold in (None, "measure", "fixed", 0, 0.65, 1):
    SparseExecution(threshold=threshold)
  for groups in (None, "auto", "from_state", 2, [[0, 1], [2, 3]], {"conv1/kernel": 2}):
    SparseExecution(filter_groups=groups, input_shape=(2, 9, 9, 1), repeats=1)
  model = _Net(nnx.Rngs(0))
  _, report = to_sparse_layers(model, _masks(model), threshold=1.0)  # no sparsity exceeds 1
  assert [c.backend for c in report] == ["dense"] * 3


def test_plan_reads_the_model_and_apply_swaps_what_it_planned():
  from jaxprune.clicktrain.execution import SparseExecutionConfig, conversion

  model = _Net(nnx.Rngs(0))
  masks = _masks(model)
  config = SparseExecutionConfig(threshold=0.0, backend="reference")
  report = conversion.plan_sparse_layers(model, masks, config)
  assert not pattern_convs(model)  # planning leaves the model as it was
  assert [c.backend for c in report] == ["reference"] * 3
  assert conversion.apply_sparse_layers(model, report) is model
  assert sorted(pattern_convs(model)) == ["conv1", "conv2", "conv3"]
  # One config, given whole or as its fields, not both; "from_state" needs an optimizer state.
  _, same = to_sparse_layers(_Net(nnx.Rngs(0)), masks, config)
  assert [c.backend for c in same] == [c.backend for c in report]
  with pytest.raises(ValueError, match="not both"):
    to_sparse_layers(_Net(nnx.Rngs(0)), masks, config, threshold=0.0)
  with pytest.raises(ValueError, match="filter_groups must be None, 'auto', a group"):
    to_sparse_layers(_Net(nnx.Rngs(0)), masks, filter_groups="from_state", threshold=0.0)
  assert SparseExecution(config).config is config


def test_convert_model_is_a_deprecated_name_of_to_sparse_layers():
  model = _Net(nnx.Rngs(0))
  with pytest.warns(DeprecationWarning, match="to_sparse_layers"):
    converted, report = clicktrain.convert_model(model, _masks(model), threshold=0.0)
  assert converted is model and [c.backend for c in report] != ["dense"] * 3
  assert "convert_model" not in clicktrain.__all__


def test_the_hook_finds_the_clicktrain_state_once_per_conversion(monkeypatch):
  from jaxprune.clicktrain.execution import hook as hook_module

  found = []
  real = hook_module.find_state
  monkeypatch.setattr(hook_module, "find_state", lambda s: found.append(s) or real(s))
  model = _Net(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  tx = clicktrain.clicktrain(optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=1)
  state = tx.init(params)
  state = state._replace(stage=jnp.asarray(clicktrain.Stage.REGULARIZE, jnp.int32))

  class _Trainer:
    opt_state = state

  hook = SparseExecution(threshold=0.0)
  _Trainer.model = model
  hook._convert(_Trainer())  # not pruned yet: nothing converted, the state found once
  assert len(found) == 1 and hook.choices is None

"""ClickTrain's aligned mode in training: the switch to AlignedConv, resume, SDGP, PruneTrain."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain, data, models, sdgp, train
from jaxprune import prunetrain as pt
from jaxprune.clicktrain.execution import AlignedConv, SparseExecution, pattern_convs
from jaxprune.clicktrain.execution.aligned_layout import build_aligned_layout

GROUPS = 2


def _loader():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 10, size=32).astype(np.int32)
  images = rng.integers(0, 256, size=(32, 8, 8, 3), dtype=np.uint8)
  images[:, :3, :3, 0] = (labels * 25)[:, None, None].astype(np.uint8)
  dataset = data.Dataset.from_arrays(images, labels, num_classes=10)
  return data.Loader(dataset, 16, shuffle=True, seed=0, drop_last=True, prefetch=0)


def _model():
  """He et al. basic blocks, one per stage, widths 8/16/32 (divisible by the groups)."""
  return models.ResNet(
    models.prunetrain_resnet_spec(8).scaled(0.5), num_classes=10, rngs=nnx.Rngs(0)
  )


def _tx(steps_per_epoch, **kw):
  return clicktrain.clicktrain(
    optax.sgd(0.05, momentum=0.9),
    steps_per_epoch=steps_per_epoch,
    mode="one_shot",
    one_shot_epoch=1,
    hard_prune_epoch=2,
    kernel_prune_ratio=0.5,
    filter_groups=GROUPS,
    **kw,
  )


def _run(hooks, *, epochs=4, checkpoint_dir=None, **kw):
  loader = _loader()
  trainer = train.Trainer(
    _model(), _tx(len(loader), **kw), callbacks=hooks, checkpoint_dir=checkpoint_dir, progress=False
  )
  return trainer, trainer.fit(loader, epochs=epochs)


@pytest.fixture(scope="module")
def measured_run():
  hook = SparseExecution(filter_groups=GROUPS)  # measures each layer at the loader's shape
  return (*_run([hook]), hook)


def test_training_after_the_switch_matches_the_masked_dense_model(measured_run):
  sparse, h_sparse, hook = measured_run
  dense, h_dense = _run([])
  assert all(c.dense_ms > 0 and c.sparse_ms > 0 for c in hook.choices)  # timed, both ways
  # In every record: the layers running sparse after the epoch, 0 before the switch.
  sparse_now = sum(c.backend != "dense" for c in hook.choices)
  assert [r["sparse_layers"] for r in h_sparse] == [0] + [sparse_now] * 3
  # G = 2: each layer's columns per group or shared, whichever measured faster
  assert {c.backend for c in hook.choices} <= {"aligned", "aligned (shared columns)", "dense"}
  for a, b in zip(h_sparse, h_dense):
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-4)
  params = nnx.as_pure(nnx.state(sparse.model, nnx.Param))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5),
    params,
    nnx.as_pure(nnx.state(dense.model, nnx.Param)),
  )
  weight_masks = clicktrain.masks(sparse.opt_state, params)
  for mask, weight in zip(
    jax.tree.leaves(weight_masks), jax.tree.leaves(params, is_leaf=lambda x: x is None)
  ):
    build_aligned_layout(mask, GROUPS)  # the final masks are shared within each group
  by_path = {c.path: c.backend for c in hook.choices}
  for path, layer in pattern_convs(sparse.model).items():
    assert isinstance(layer, AlignedConv), path
    shared = by_path[path] == "aligned (shared columns)"
    assert layer.columns == ("shared" if shared else "per_group"), path


# Slow: three trainings. The resume across the switch to the aligned layers is tested fast in
# test_sparse_execution.py (test_resume_across_the_switch_is_exact), and the specialised step
# equals the general one in test_pruned_step.py.
@pytest.mark.slow
def test_resume_across_the_switch_is_exact(tmp_path):
  # With the step specialised to the pruned stage from the prune on (PrunedStageStep): the
  # checkpoint stores the same arrays, and the resumed run specialises again at fit start.
  def hook():
    return [SparseExecution(threshold=0.0, filter_groups=GROUPS), clicktrain.PrunedStageStep()]

  straight, h_straight = _run(hook())
  assert [r["ct_pruned_step"] for r in h_straight] == [False, True, True, True]
  _run(hook(), epochs=3, checkpoint_dir=tmp_path)  # switched at the end of epoch 2
  resumed, h_resumed = _run(hook(), checkpoint_dir=tmp_path)  # switches again at fit start
  assert clicktrain.is_specialized(resumed.opt_state)
  assert pattern_convs(resumed.model) and set(pattern_convs(resumed.model)) == set(
    pattern_convs(straight.model)
  )
  assert [r["train_loss"] for r in h_resumed] == [r["train_loss"] for r in h_straight]
  jax.tree.map(
    np.testing.assert_array_equal,
    nnx.state(resumed.model, nnx.Param),
    nnx.state(straight.model, nnx.Param),
  )


def test_clustered_groups_convert_from_the_state_and_train_as_the_masked_dense_model():
  # The clustered partition is read from the optimizer state; the aligned layers produce their
  # filters group by group and must permute them back: the next epoch (trained on the aligned
  # layers) matches the masked dense model's.
  hook = SparseExecution(threshold=0.0, filter_groups="from_state")
  sparse, h_sparse = _run([hook], epochs=3, filter_grouping="clustered")
  dense, h_dense = _run([], epochs=3, filter_grouping="clustered")
  assert [r["sparse_layers"] for r in h_sparse] == [0, len(hook.choices), len(hook.choices)]
  partition = clicktrain.filter_partition(sparse.opt_state)
  layers = pattern_convs(sparse.model)
  assert len(layers) == len(partition)
  shuffled = 0
  for path, layer in layers.items():
    assert isinstance(layer, AlignedConv), path
    assert [g.filters for g in layer.layout.groups] == list(partition[f"{path}/kernel"])
    shuffled += layer.layout.filter_order != tuple(range(len(layer.layout.filter_order)))
  assert shuffled  # some layer's groups are not consecutive: its outputs are permuted back
  for a, b in zip(h_sparse, h_dense):
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-4)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5),
    nnx.as_pure(nnx.state(sparse.model, nnx.Param)),
    nnx.as_pure(nnx.state(dense.model, nnx.Param)),
  )


def test_aligned_layers_compose_with_sdgp():
  # Converted from an SDGP model, an AlignedConv keeps SDGP's wrapper: the same loss, input
  # gradient and (kept) kernel gradients as the SDGP model with masked weights.
  model = sdgp.convert_model(_model(), n=2, m=4, method="magnitude")
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  rng = np.random.default_rng(1)
  masks = jax.tree.map(lambda _: None, params)
  for block in range(3):
    for conv in ("conv1", "conv2"):
      w = params["stages"][block][0][conv]["conv"]["kernel"]
      taps = (rng.random((GROUPS, w.shape[2], 1, 1)) < 0.6) * clicktrain.library_patterns()[
        rng.integers(0, 12, (GROUPS, w.shape[2]))
      ]
      mask = clicktrain.execution.aligned_mask(taps, w.shape[3])
      masks["stages"][block][0][conv]["conv"]["kernel"] = jnp.asarray(mask)
  nnx.update(
    model,
    jax.tree.map(
      lambda p, m: p if m is None else p * m, params, masks, is_leaf=lambda x: x is None
    ),
  )
  x = jnp.asarray(rng.normal(size=(2, 8, 8, 3)), jnp.float32)

  @nnx.jit
  def loss_grads(m):
    return nnx.value_and_grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1))(m, x)

  loss0, (grads0, dx0) = loss_grads(model)
  clicktrain.to_sparse_layers(model, masks, threshold=0.0, filter_groups=GROUPS)
  conv = model.stages[0][0].conv1.conv
  assert isinstance(conv, AlignedConv) and conv.conv_general_dilated.settings.n == 2
  loss1, (grads1, dx1) = loss_grads(model)
  np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
  np.testing.assert_allclose(dx1, dx0, rtol=1e-4, atol=1e-6)
  grads0 = jax.tree.map(
    lambda g, m: g if m is None else g * m, nnx.as_pure(grads0), masks, is_leaf=lambda x: x is None
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), nnx.as_pure(grads1), grads0
  )


# Slow: ClickTrain's state sliced through a reconfiguration is tested in
# tests/prunetrain/test_composition.py, the aligned masks and their lifted lasso in
# tests/clicktrain/test_transform_aligned.py.
@pytest.mark.slow
def test_aligned_masks_survive_a_prunetrain_reconfiguration():
  loader = _loader()
  tx = pt.with_group_lasso(_tx(len(loader)))
  trainer = train.Trainer(_model(), tx, progress=False)
  trainer.fit(loader, epochs=3)
  model = trainer.model
  block = model.stages[0][0]
  for kernel, axis in ((block.conv1.conv.kernel, 3), (block.conv2.conv.kernel, 2)):
    array = np.array(kernel[...])
    np.moveaxis(array, axis, 0)[[1, 2, 5]] = 0.0  # uneven: 2 filters of group 0, 1 of group 1
    kernel[...] = array
  # channel_multiple=GROUPS keeps every width divisible by the groups (5 kept -> 6).
  new_model, new_opt_state, _ = pt.reconfigure(
    model, trainer.opt_state, count_flops=False, channel_multiple=GROUPS
  )
  assert new_model.stages[0][0].conv1.conv.kernel.shape[3] == 6
  trainer.replace(new_model, new_opt_state)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 8, 3)), jnp.float32)
  new_model.eval()
  before = new_model(x)
  hook = SparseExecution(threshold=0.0, filter_groups="auto")  # groups read off the masks
  hook.on_epoch_end(trainer, 3)
  converted = trainer.model
  assert isinstance(converted.stages[0][0].conv1.conv, AlignedConv)
  converted.eval()
  np.testing.assert_allclose(converted(x), before, rtol=1e-4, atol=1e-5)
  history = trainer.fit(loader, epochs=4)
  assert np.isfinite(history[-1]["train_loss"])


def test_the_preset_runs_the_aligned_layers_it_trains_for():
  from jaxprune import methods

  run = methods.Run(steps_per_epoch=3, epochs=10)

  def sparse_hooks(method):
    return [h for h in method.callbacks(run) if isinstance(h, SparseExecution)]

  (hook,) = sparse_hooks(methods.get("clicktrain", filter_groups=2))
  assert hook.config.filter_groups == "from_state" and hook.config.threshold is None  # measured
  assert sparse_hooks(methods.get("clicktrain", filter_groups=2, sparse_execution=False)) == []
  assert sparse_hooks(methods.get("clicktrain")) == []  # the paper's layout: masked dense convs
  with pytest.raises(ValueError, match="sparse_execution must be a bool"):
    methods.get("clicktrain", filter_groups=2, sparse_execution="yes")

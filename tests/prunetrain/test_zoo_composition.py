"""ClickTrain composed with PruneTrain on the zoo's ResNet-20 (issue 61, item 2): the
reconfiguration narrows a block to 3 input channels and removes a whole branch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import clicktrain, methods, models, train


class _Kill(train.Callback):
  """At the end of ``epoch``, before PruneTrain's hook: zero the branch of block ``stages/0/0``
  and one inner channel of block ``stages/0/1`` (what group lasso does over many epochs)."""

  def __init__(self, epoch):
    self.epoch = epoch

  def on_epoch_end(self, trainer, epoch):
    if epoch != self.epoch:
      return
    model = trainer.model
    first, second = model.stages[0][0], model.stages[0][1]
    for conv in (first.conv1, first.conv2):
      conv.conv.kernel[...] = jnp.zeros_like(conv.conv.kernel[...])
    second.conv1.conv.kernel[..., 0] = 0.0  # its output channel 0 ...
    second.conv2.conv.kernel[:, :, 0, :] = 0.0  # ... where it is read
    trainer.replace(model, trainer.opt_state)


def _resnet20():
  return models.create(
    "prunetrain-resnet20", num_classes=4, rngs=nnx.Rngs(0), width_multiplier=0.25, in_channels=1
  )


# Slow (half a minute): composition through reconfigurations is tested in tests/test_methods.py,
# and the layer choice by structure (a narrowed conv is no stem) in
# tests/clicktrain/test_layer_choice.py.
@pytest.mark.slow
def test_zoo_resnet20_composition_trains_through_a_branch_removal(digits_loader):
  """After ClickTrain's hard prune (end of epoch 2), the reconfiguration at the end of epoch 3
  removes the branch of ``stages/0/0`` and narrows ``stages/0/1/conv2`` to 3 input channels;
  epoch 4 trains on, and the pruned weights stay zero.

  Before: ``ValueError: opt_state: structure or shapes do not match tx.init(model params)``
  at that reconfiguration: ClickTrain's default layer choice took the narrowed conv (3 input
  channels) for a stem, so ``tx.init`` left it out while the sliced state kept it."""
  loader = digits_loader(n=64)
  method = methods.compose(
    methods.get(
      "clicktrain-one-shot", one_shot_epoch=1, hard_prune_epoch=2, kernel_prune_ratio=0.5
    ),
    methods.get("prunetrain", every_epochs=3, dynamic_batch=False),
  )
  run = methods.Run.from_loader(loader, epochs=4)
  tx = method.make_tx(train.sgd(0.05, momentum=0.9), run)
  callbacks = [_Kill(3), *method.callbacks(run)]
  trainer = train.Trainer(method.convert(_resnet20()), tx, callbacks=callbacks, progress=False)
  history = trainer.fit(loader, epochs=4)

  assert [bool(r["pt_reconfigured"]) for r in history] == [False, False, True, False]
  assert np.isfinite(history[-1]["train_loss"])
  model = trainer.model
  assert not model.stages[0][0].has_branch
  assert model.stages[0][1].conv2.conv.kernel.shape[2] == 3
  masks = clicktrain.masks(trainer.opt_state, trainer.params)
  assert "stages/0/1/conv2/conv/kernel" in clicktrain.find_state(trainer.opt_state).layers
  leaves = lambda t: jax.tree.leaves(t, is_leaf=lambda v: v is None)
  pruned = 0
  for w, m in zip(leaves(trainer.params), leaves(masks), strict=True):
    if m is not None:
      assert np.all(np.asarray(w)[np.asarray(m) == 0] == 0)
      pruned += int((np.asarray(m) == 0).sum())
  assert pruned > 0


def test_a_wrong_opt_state_is_named_by_its_first_differing_leaf():
  """Before: "opt_state: structure or shapes do not match tx.init(model params)", no leaf."""
  model = _resnet20()
  trainer = train.Trainer(model, train.sgd(0.1, momentum=0.9), progress=False)
  flat, treedef = jax.tree_util.tree_flatten_with_path(trainer.opt_state)
  path, leaf = next((p, x) for p, x in flat if "head" in jax.tree_util.keystr(p) and np.ndim(x))
  wrong = jax.tree.unflatten(
    treedef, [jnp.zeros((*np.shape(x), 2)) if p == path else x for p, x in flat]
  )
  with pytest.raises(ValueError, match="tx.init") as raised:
    trainer.replace(model, wrong)
  message = str(raised.value)
  assert jax.tree_util.keystr(path) in message
  assert f"expected shape {tuple(np.shape(leaf))}, got {(*np.shape(leaf), 2)}" in message
  # A leaf short: the first leaf the state lacks is named.
  with pytest.raises(ValueError, match="missing from the state"):
    trainer.replace(model, jax.tree.unflatten(treedef, [x for _, x in flat])[:-1])

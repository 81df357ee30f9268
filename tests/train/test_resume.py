"""Trainer checkpoints: exact resume, interrupted and damaged checkpoints, run config checks,
the checkpoint store and the spec JSON."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprune.train as jt
from jaxprune.train._spec_json import decode_spec, encode_spec


# ----------------------------------------------------------------------------- checkpoints


def _loaders(kit, use_data_package):
  images, labels = kit.data(48)
  if use_data_package:
    from jaxprune import data

    # The same small images as uint8, through the data package's seeded, resumable loader
    # with augmentation (pad-crop + flip draws depend on (seed, epoch, step)).
    uint8 = np.clip(images * 40 + 128, 0, 255).astype(np.uint8)
    dataset = data.Dataset.from_arrays(uint8, labels)
    return (
      data.Loader(dataset, 8, shuffle=True, seed=3, augment="prunetrain", prefetch=0),
      data.Loader(dataset, 8, shuffle=False, drop_last=False, prefetch=0),
    )
  return (
    kit.ArrayLoader(images, labels, 8, seed=3),
    kit.ArrayLoader(images[:16], labels[:16], 8, shuffle=False),
  )


def _run(kit, tmp_path, epochs, hook=None, use_data_package=False):
  train, test = _loaders(kit, use_data_package)
  model = kit.model()
  trainer = kit.trainer(
    model,
    checkpoint_dir=tmp_path / "ckpt",
    log_path=tmp_path / "log.jsonl",
    callbacks=[hook] if hook else [],
  )
  trainer.fit(train, test, epochs=epochs)
  return trainer


@pytest.mark.parametrize("reconfigure, stop", [(False, 2), (True, 1)])
def test_resume_is_exact(tmp_path, reconfigure, stop, kit):
  """4 epochs straight == `stop` epochs, stop, fresh trainer resumes, finishes.

  Without ``reconfigure`` the data come from ``jaxprune.data.Loader`` (shuffle and
  augmentation draws seeded per epoch, position saved via ``state()``). With it a hook
  shrinks the model and asks for a doubled batch after epoch 1, so the resume must rebuild
  the smaller model from the checkpoint's spec (stop=1: and apply the pending batch change).
  """
  make_hook = (lambda: kit.BatchAndWidthHook()) if reconfigure else (lambda: None)
  use_data = not reconfigure
  straight = _run(kit, tmp_path / "a", 4, make_hook(), use_data)
  _run(kit, tmp_path / "b", stop, make_hook(), use_data)  # stop after `stop` epochs ...
  resumed = _run(kit, tmp_path / "b", 4, make_hook(), use_data)  # ... fresh trainer, resume, finish
  assert resumed.epoch == 4 and resumed.step == straight.step
  assert kit.strip_timing(resumed.history) == kit.strip_timing(straight.history)
  kit.assert_trees_equal(
    nnx.as_pure(nnx.state(resumed.model)), nnx.as_pure(nnx.state(straight.model))
  )
  kit.assert_trees_equal(resumed.opt_state, straight.opt_state)
  logged = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
  assert [r["epoch"] for r in logged] == [1, 2, 3, 4]
  # the run actually trained (resume of an untrained model would pass trivially)
  assert straight.history[-1]["train_loss"] < straight.history[0]["train_loss"]


def test_interrupted_checkpoint_write_is_not_resumed(tmp_path, monkeypatch, kit):
  import orbax.checkpoint as ocp

  images, labels = kit.data(48)
  loader = kit.ArrayLoader(images, labels, 8)
  trainer = kit.trainer(checkpoint_dir=tmp_path / "ckpt")
  trainer.fit(loader, epochs=1)
  good_params = jax.tree.map(np.asarray, trainer.params)

  # Interrupt the next save after the arrays were written but before the metadata
  # and the final rename (as a crash or kill mid-write would). Not a KeyboardInterrupt, which
  # asyncio and XLA's callbacks treat as the user's; and async_save a coroutine like the one
  # it replaces, so orbax awaits the arrays' save before the crash.
  class Crash(BaseException):
    pass

  def crash(*args, **kwargs):
    raise Crash("simulated crash during checkpoint write")

  async def crash_async(*args, **kwargs):
    crash()

  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "save", crash)
  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "async_save", crash_async, raising=False)
  with pytest.raises(Crash):
    trainer.fit(loader, epochs=2)
  monkeypatch.undo()
  leftovers = sorted(os.listdir(tmp_path / "ckpt"))
  assert "1" in leftovers and "2" not in leftovers, leftovers
  trainer.close()  # the crashed run lets its folder go, as its process would by ending
  fresh = kit.trainer(kit.model(seed=9), checkpoint_dir=tmp_path / "ckpt")
  assert fresh.store.latest_step() == 1
  assert fresh.restore_checkpoint(loader)
  assert fresh.epoch == 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fresh.params), good_params)


def test_resume_refuses_a_differently_configured_run(tmp_path, kit):
  images, labels = kit.data(48)
  loader = kit.ArrayLoader(images, labels, 8)
  ckpt = tmp_path / "ckpt"
  kit.trainer(checkpoint_dir=ckpt, run_config={"epochs": 3, "milestones": (2,)}).fit(
    loader, epochs=1
  )
  # the same config (a tuple stored as a JSON list still compares equal) resumes
  same = kit.trainer(
    kit.model(seed=9), checkpoint_dir=ckpt, run_config={"epochs": 3, "milestones": [2]}
  )
  assert same.restore_checkpoint(loader) and same.epoch == 1
  same.close()  # (a live trainer holds its folder)
  other = kit.trainer(
    kit.model(seed=9), checkpoint_dir=ckpt, run_config={"epochs": 10, "milestones": [5]}
  )
  with pytest.raises(ValueError, match=r"run_config.*epochs: checkpoint 3 vs now 10"):
    other.fit(loader, epochs=2)
  assert other.epoch == 0  # nothing was restored
  with pytest.raises(ValueError, match="run_config"):
    kit.trainer(run_config={"schedule": lambda step: 0.1})


def test_resume_refuses_the_checkpoints_of_a_run_of_another_model(tmp_path, kit):
  # One checkpoint_dir, two runs: the second trainer (another model and seed, resume=True by
  # default) must not adopt the first run's checkpoint.
  images, labels = kit.data(48)
  loader = kit.ArrayLoader(images, labels, 8)
  ckpt = tmp_path / "ckpt"
  kit.trainer(checkpoint_dir=ckpt).fit(loader, epochs=1)
  spec = type(kit.model().spec)
  wider = kit.trainer(kit.model(seed=5, spec=spec(widths=(6,))), checkpoint_dir=ckpt)
  with pytest.raises(
    ValueError,
    match=r"model: the checkpoints of .*ckpt belong to a run of another model \(spec: "
    r"checkpoint .*4.* vs now .*6.*; param b1/bias: checkpoint \(4,\) vs now \(6,\); "
    r"\.\.\. 3 more\)",
  ):
    wider.fit(loader, epochs=2)
  assert wider.epoch == 0  # nothing was restored
  other_head = kit.trainer(_model_with_classes(kit, 4), checkpoint_dir=ckpt)
  with pytest.raises(
    ValueError, match=r"\(param head/bias: checkpoint \(3,\) vs now \(4,\); param head/kernel"
  ):
    other_head.restore_checkpoint(loader)
  # the same model, another seed: the same run's structure, resumed
  same = kit.trainer(kit.model(seed=9), checkpoint_dir=ckpt)
  assert same.restore_checkpoint(loader) and same.epoch == 1


def _model_with_classes(kit, num_classes):
  model = kit.model(seed=7)
  return type(model)(model.spec, num_classes=num_classes, rngs=nnx.Rngs(7))


def test_fresh_start_does_not_leave_the_old_runs_checkpoints_as_latest(tmp_path, kit):
  images, labels = kit.data(48)
  loader = kit.ArrayLoader(images, labels, 8)
  ckpt = tmp_path / "ckpt"
  kit.trainer(checkpoint_dir=ckpt).fit(loader, epochs=2)  # the old run: checkpoints 1 and 2
  fresh = kit.trainer(kit.model(seed=5), checkpoint_dir=ckpt)
  with pytest.raises(ValueError, match=r"checkpoint_dir .*ckpt already holds .*\[1, 2\]"):
    fresh.fit(loader, epochs=1, resume=False)
  assert fresh.epoch == 0 and fresh.store.all_steps() == [1, 2]  # refused before training
  fresh.fit(loader, epochs=1, resume=False, overwrite=True)
  assert fresh.store.all_steps() == [1]
  fresh.fit(loader, epochs=2, resume=False)  # going on with its own run is not refused
  fresh.close()
  # a later resume continues the fresh run, not the old one
  later = kit.trainer(kit.model(seed=9), checkpoint_dir=ckpt)
  assert later.restore_checkpoint(loader) and later.epoch == 2
  kit.assert_trees_equal(later.params, fresh.params)
  with pytest.raises(ValueError, match="overwrite"):
    later.fit(loader, epochs=2, overwrite=True)


def test_fit_to_fewer_epochs_than_the_checkpoint_holds_warns(tmp_path, kit):
  images, labels = kit.data(48)
  loader = kit.ArrayLoader(images, labels, 8)
  ckpt = tmp_path / "ckpt"
  kit.trainer(checkpoint_dir=ckpt).fit(loader, epochs=3)
  resumed = kit.trainer(kit.model(seed=9), checkpoint_dir=ckpt)
  with pytest.warns(UserWarning, match=r"epochs=2.*already at epoch 3.*ckpt"):
    history = resumed.fit(loader, epochs=2)
  assert len(history) == 3 and resumed.epoch == 3 and resumed.store.latest_step() == 3


def _two_checkpoints(kit, tmp_path):
  """A tiny run's checkpoints 1 and 2; returns the loader, the folder, epoch 1's params."""
  loader = kit.ArrayLoader(*kit.data(48), 8)
  trainer = kit.trainer(checkpoint_dir=tmp_path / "ckpt")
  trainer.fit(loader, epochs=1)
  params1 = jax.tree.map(np.asarray, trainer.params)
  trainer.fit(loader, epochs=2)
  return loader, tmp_path / "ckpt", params1


def _damage(step_dir, how):
  if how == "delete_item":  # a missing item: a bare KeyError before
    shutil.rmtree(step_dir / "arrays")
    return
  # a truncated array file: the arrays' JSON metadata (a bare JSONDecodeError before) or
  # the array data themselves
  files = [step_dir / "arrays" / "_METADATA"]
  if how == "truncate_data":
    files = [p for p in (step_dir / "arrays" / "d").iterdir()]
  for path in files:
    with open(path, "r+b") as f:
      f.truncate(path.stat().st_size // 2)


# A truncated array file made orbax's storage threads report into the closed event loop of the
# failed read ("Exception ignored ... Event loop is closed" on stderr, an unraisable-exception
# warning here); the damage is named by the library's own warning instead.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", ["truncate_metadata", "truncate_data", "delete_item"])
def test_damaged_newest_checkpoint_is_named_and_the_newest_intact_one_resumed(tmp_path, how, kit):
  loader, ckpt, params1 = _two_checkpoints(kit, tmp_path)
  _damage(ckpt / "2", how)
  fresh = kit.trainer(kit.model(seed=9), checkpoint_dir=ckpt)
  with pytest.warns(UserWarning, match=r"checkpoint 2 at \S*ckpt/2 is damaged.*from checkpoint 1"):
    assert fresh.restore_checkpoint(loader)
  assert fresh.epoch == 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fresh.params), params1)
  # set aside, so the resumed run writes epoch 2 again
  assert fresh.store.all_steps() == [1] and (ckpt / "2.damaged").is_dir()
  fresh.fit(loader, epochs=2)
  assert fresh.store.all_steps() == [1, 2]


def test_no_intact_checkpoint_refuses_naming_each_damaged_one(tmp_path, kit):
  loader, ckpt, _ = _two_checkpoints(kit, tmp_path)
  _damage(ckpt / "2", "truncate_metadata")
  _damage(ckpt / "1", "delete_item")
  fresh = kit.trainer(kit.model(seed=9), checkpoint_dir=ckpt)
  with pytest.raises(
    jt.DamagedCheckpointError, match=r"checkpoint 2 at .*no intact.*checkpoint 1 at \S*ckpt/1"
  ):
    fresh.fit(loader, epochs=2)
  assert fresh.epoch == 0 and fresh.store.all_steps() == [1, 2]  # nothing restored or moved


def test_checkpoint_store_rejects_wrong_shapes(tmp_path):
  store = jt.CheckpointStore(tmp_path / "c")
  store.save(1, {"a": {"w": jnp.ones((2, 3))}}, {"epoch": 1})
  with pytest.raises(ValueError) as wrong_shape:
    store.restore(1, {"a": {"w": jnp.ones((4, 3))}})
  with pytest.raises(
    ValueError, match=r"template.*not in the checkpoint \[\"\['a'\]\['v'\]\"\]"
  ) as extra:
    store.restore(1, {"a": {"w": jnp.ones((2, 3)), "v": jnp.ones(2)}})
  # a template that does not fit is not the checkpoint's damage
  assert not isinstance(wrong_shape.value, jt.DamagedCheckpointError)
  assert not isinstance(extra.value, jt.DamagedCheckpointError)
  arrays, meta = store.restore(1, {"a": {"w": jnp.zeros((2, 3))}})
  np.testing.assert_array_equal(arrays["a"]["w"], np.ones((2, 3)))
  assert meta == {"epoch": 1}


def test_spec_json_round_trip(kit):
  spec = kit.TinySpec((7, 9))
  data = json.loads(json.dumps(encode_spec(spec)))
  assert decode_spec(data) == spec
  with pytest.raises(ValueError, match="spec"):
    encode_spec(object())


def test_orbax_error_lines_of_a_damaged_checkpoint_stay_out_of_the_log(tmp_path, kit, caplog):
  import logging

  # Before: two "ERROR:absl:Failed to json parse Metadata file ..." lines in the user's log
  # (orbax's own metadata, which the restore does without), beside the library's warning.
  loader, ckpt, params1 = _two_checkpoints(kit, tmp_path)
  for step in ("1", "2"):
    meta = ckpt / step / "_CHECKPOINT_METADATA"
    meta.write_text(meta.read_text()[:20])
  _damage(ckpt / "2", "truncate_metadata")
  caplog.set_level(logging.DEBUG)
  fresh = kit.trainer(kit.model(seed=9), checkpoint_dir=ckpt)
  with pytest.warns(UserWarning, match=r"checkpoint 2 at \S*ckpt/2 is damaged"):
    assert fresh.restore_checkpoint(loader)
  assert fresh.epoch == 1
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fresh.params), params1)
  assert not [r for r in caplog.records if r.name == "absl"]
  # kept for whoever asks for debug output
  debug = [r.getMessage() for r in caplog.records if r.name == "jaxprune.train.checkpoint"]
  assert any("Failed to json parse" in m for m in debug), debug

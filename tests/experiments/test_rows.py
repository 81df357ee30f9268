"""The shared row pipeline (experiments/common/rows.py) and the typed run options: a row stopped
at its time box and resumed saves what an uninterrupted row saves; options carry their own
clock and leave the parsed arguments alone."""

import argparse
import dataclasses
import json
import time

import numpy as np
import pytest
from flax import nnx

from experiments.common import rows, run_options
from experiments.common.run_options import RunOptions
from jaxprune import data, methods, models, train


def _tiny_sets():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(48, 8, 8, 3), dtype=np.uint8)
  labels = np.arange(48, dtype=np.int32) % 10
  train_set = data.Dataset.from_arrays(images, labels, num_classes=10)
  return train_set, data.Dataset.from_arrays(images[:16], labels[:16], num_classes=10)


def _spec(folder, saved):
  """A three-epoch dense row of a quarter-width ResNet-8 on 8x8 images, saving to ``saved``."""
  train_set, test_set = _tiny_sets()

  def model():
    spec = models.prunetrain_resnet_spec(8)
    return models.create(
      "prunetrain-resnet20", spec=spec, num_classes=10, rngs=nnx.Rngs(0), width_multiplier=0.25
    )

  def result(row):
    history = row.trainer.history
    figures = [{k: r[k] for k in ("epoch", "train_loss", "test_acc")} for r in history]
    return {"method": row.method, "test_acc": history[-1]["test_acc"], "history": figures}

  return rows.RowSpec(
    label="tiny dense",
    model=model,
    method=methods.get("dense"),
    optimizer=lambda steps: train.sgd(0.1, momentum=0.9),
    train_set=train_set,
    test_set=test_set,
    batch_size=16,
    augment="prunetrain",
    epochs=3,
    seed=0,
    result=result,
    log_path=folder / "log.jsonl",
    checkpoint_dir=folder / "checkpoints",
    run_config={"row": "tiny"},
    save=saved.append,
  )


_HOST = RunOptions(loader="host", steps_per_dispatch=1, eval_every=1, checkpoint_every=1)


def test_a_row_stopped_at_its_time_box_and_resumed_saves_what_an_uninterrupted_row_saves(
  tmp_path,
):
  whole, parts = [], []
  (tmp_path / "whole").mkdir()
  (tmp_path / "parts").mkdir()
  uninterrupted = rows.run_row(_spec(tmp_path / "whole", whole), _HOST)
  assert whole == [uninterrupted] and not (tmp_path / "whole" / "checkpoints").exists()

  spec = _spec(tmp_path / "parts", parts)
  boxed = dataclasses.replace(_HOST, max_seconds=1e-3)
  with pytest.warns(RuntimeWarning, match="fit stopped after epoch 1 of 3"):
    assert rows.run_row(spec, boxed) is None
  assert parts == []  # nothing saved, the checkpoint kept for --resume
  assert (tmp_path / "parts" / "checkpoints" / "1").exists()
  resumed = rows.run_row(spec, dataclasses.replace(_HOST, resume=True))
  assert parts == [resumed] and not (tmp_path / "parts" / "checkpoints").exists()

  def stable(record):  # where and when it ran aside
    return json.dumps({k: v for k, v in record.items() if k not in ("machine", "date")})

  assert stable(resumed) == stable(uninterrupted)
  assert resumed["loader"] == "host" and resumed["machine"] and resumed["date"]
  assert list(resumed)[-1] == "history"


def test_a_resume_under_another_row_config_is_refused(tmp_path):
  saved = []
  spec = _spec(tmp_path, saved)
  with pytest.warns(RuntimeWarning, match="fit stopped"):
    rows.run_row(spec, dataclasses.replace(_HOST, max_seconds=1e-3))
  other = dataclasses.replace(spec, run_config={"row": "another"})
  with pytest.raises(ValueError, match="row"):
    rows.build_row(other, dataclasses.replace(_HOST, resume=True))
  assert saved == []


def test_each_options_object_keeps_its_own_clock():
  """The time box counts from when the command resolved its options, held by the options
  (no module state): a later command's options leave an earlier one's box as it was."""
  early = RunOptions("host", 1, 1, 1, max_seconds=10.0, started=time.perf_counter() - 9.5)
  late = RunOptions("host", 1, 1, 1, max_seconds=10.0)
  assert run_options.fit_kwargs(early)["max_seconds"] <= 0.5
  assert run_options.fit_kwargs(late)["max_seconds"] > 9.0
  assert run_options.fit_kwargs(early)["max_seconds"] <= 0.5
  assert early == dataclasses.replace(early, started=0.0)  # the clock is not a setting
  assert run_options.fit_kwargs(dataclasses.replace(late, max_seconds=None)) == {}


def test_resolving_the_options_leaves_the_parsed_arguments_alone():
  parser = argparse.ArgumentParser()
  parser.add_argument("--budget", default="cpu")
  parser.add_argument("--resume", action="store_true")
  run_options.add_arguments(parser)
  args = parser.parse_args(["--resume"])
  before = dict(vars(args))
  options = run_options.resolve(args, "cpu")
  assert vars(args) == before
  assert options.loader in ("host", "device") and options.resume
  assert options.eval_every >= 1 and options.checkpoint_every >= 0
  table = run_options.table_args(args, "prunetrain_table1")
  assert vars(args) == before
  # the unresolved flags are not left beside their resolved values
  assert not {"loader", "eval_every", "max_seconds"} & set(vars(table))
  assert table.options == options and table.recipe.epochs == 10
  assert table.options.as_flags()["loader"] == options.loader

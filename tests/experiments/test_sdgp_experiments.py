"""SDGP experiment plumbing: argument parsing, budgets, the conv-layer recorder, Fig. 8 layout."""

import argparse

import pytest
from flax import nnx

from experiments import sdgp_fig8, sdgp_table1, sdgp_timemodel
from jaxprune import models


def test_fig8_settings_parse_and_reject():
  assert sdgp_fig8._parse_settings("2:4,4:32") == [(2, 4), (4, 32)]
  for bad in ("2-4", "5:4", "1:64", "0:4"):
    with pytest.raises(ValueError, match="--settings"):
      sdgp_fig8._parse_settings(bad)


def test_budget_overrides_and_lr_scaling():
  parser = argparse.ArgumentParser()
  sdgp_table1.add_budget_arguments(parser)
  budget = sdgp_table1.resolve_budget(
    parser.parse_args(
      ["--budget", "cpu", "--epochs", "150", "--batch-size", "512", "--train-subset", "0"]
    )
  )
  # the paper's recipe comes back when the budget is the paper's
  assert budget["peak_lr"] == 0.5 and budget["peak_epoch"] == 2.0
  assert budget["train_subset"] is None
  full = sdgp_table1.resolve_budget(parser.parse_args(["--budget", "full"]))
  assert full["width"] == 1.0 and full["epochs"] == 150 and full["batch_size"] == 512


def test_timemodel_records_every_conv_with_its_shapes():
  model = models.create("sdgp-resnet9", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=0.125)
  layers = sdgp_timemodel.conv_layers(model, (2, 32, 32, 3))
  convs = [c for _, c in nnx.iter_modules(model) if isinstance(c, nnx.Conv)]
  assert len(layers) == len(convs) == 8
  assert layers[0]["lhs"] == (2, 32, 32, 3)  # the stem runs first
  for layer in layers:
    assert layer["lhs"][-1] == layer["rhs"][-2]  # input channels match the kernel
  # the recorder was removed again
  assert all(
    c.conv_general_dilated is not None
    and not isinstance(c.conv_general_dilated, sdgp_timemodel._ConvRecorder)
    for c in convs
  )


def test_fig8_resume_keeps_earlier_cells_and_trains_only_missing_ones(tmp_path, monkeypatch):
  trained = []

  def fake_train_row(method, n, m, budget, train_set, test_set, args):
    trained.append((method, n, m))
    return {"method": method, "n": n, "m": m, "test_acc": 0.5 + n / (10 * m)}

  monkeypatch.setattr(sdgp_fig8, "RESULTS", tmp_path)
  monkeypatch.setattr(sdgp_table1, "load_data", lambda args, budget: (None, None))
  monkeypatch.setattr(sdgp_table1, "train_row", fake_train_row)

  sdgp_fig8.main(["--budget", "cpu", "--no-dense", "--settings", "1:4,2:8"])
  assert trained == [("rescaled_magnitude", 1, 4), ("rescaled_magnitude", 2, 8)]
  trained.clear()
  out = sdgp_fig8.main(["--budget", "cpu", "--no-dense", "--resume", "--settings", "2:8,4:32"])
  assert trained == [("rescaled_magnitude", 4, 32)]  # 2:8 came from the file
  assert sorted((c["n"], c["m"]) for c in out["cells"]) == [(1, 4), (2, 8), (4, 32)]
  md = (tmp_path / "sdgp_fig8_cpu.md").read_text()
  assert "3 of 3" in md and "--resume" in md

  # A file written under another budget is not silently mixed in.
  with pytest.raises(ValueError, match="--resume"):
    sdgp_fig8.main(
      ["--budget", "full", "--name", "sdgp_fig8_cpu", "--no-dense", "--resume", "--settings", "1:4"]
    )

"""Table pages: SDGP Table I end to end on a tiny budget and a generated data set (two steps),
and the ClickTrain page from saved rows: the paper's numbers beside ours, logs linked."""

import dataclasses
import json
import math
import re
from pathlib import Path
from types import MappingProxyType

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import run as run_module
from experiments.clicktrain import table1 as clicktrain_table1
from experiments.common import budgets
from experiments.sdgp import fig8 as sdgp_fig8
from experiments.sdgp import table1 as sdgp_table1
from jaxprune import data, models, train


@pytest.fixture
def tiny_cifar(monkeypatch):
  def load(name, root=None, split="train"):
    # the same images on every call, as from the real archive
    rng = np.random.default_rng(0 if split == "train" else 1)
    count = 32 if split == "train" else 16
    images = rng.integers(0, 256, size=(count, 32, 32, 3), dtype=np.uint8)
    labels = (np.arange(count) % 10).astype(np.int32)
    return data.Dataset.from_arrays(images, labels, num_classes=10)

  monkeypatch.setattr(data, "load", load)


def _tiny(monkeypatch, table, **settings):
  budget = dataclasses.replace(budgets.BUDGETS[table]["cpu"], **settings)
  monkeypatch.setitem(budgets.BUDGETS, table, {"paper": budget, "cpu": budget})


def _links(page):
  return re.findall(r"\]\(([^)\s]+)\)", page)


def test_sdgp_table1_writes_one_page_with_paper_numbers_and_logs(tmp_path, monkeypatch, tiny_cifar):
  _tiny(monkeypatch, "sdgp_table1", width=0.0625, epochs=1, batch_size=16)
  sdgp_table1.main(["--rows", "magnitude", "--out", str(tmp_path)])
  page = (tmp_path / "table1_cpu.md").read_text()
  assert "| Mag. 2:4 | 95.2 |" in page
  for link in _links(page):
    assert (tmp_path / link).exists(), link
  saved = json.loads((tmp_path / "table1_cpu.json").read_text())
  assert [len(r["history"]) for r in saved["rows"]] == [1]
  assert saved["budget"] == dict(budgets.get_budget("sdgp_table1", "cpu"))


def test_sdgp_table1_rows_run_separately_share_one_page(tmp_path, monkeypatch, tiny_cifar):
  _tiny(monkeypatch, "sdgp_table1", width=0.0625, epochs=1, batch_size=16)
  sdgp_table1.main(["--rows", "mvue", "--out", str(tmp_path)])
  sdgp_table1.main(["--rows", "dense", "--out", str(tmp_path)])
  saved = json.loads((tmp_path / "table1_cpu.json").read_text())
  # both rows, in the table's order, each with the command that ran it
  assert [r["method"] for r in saved["rows"]] == ["dense", "mvue"]
  assert [r["command"].split()[-3:-2] for r in saved["rows"]] == [["dense"], ["mvue"]]
  page = (tmp_path / "table1_cpu.md").read_text()
  assert "Status: 2 of 5 rows done" in page
  assert "| Dense | 95.3 |" in page and "| MVUE 2:4 (not in paper) | — |" in page
  # a row run again replaces its old result
  first_dense = saved["rows"][0]["date"]
  sdgp_table1.main(["--rows", "dense", "--out", str(tmp_path)])
  again = json.loads((tmp_path / "table1_cpu.json").read_text())
  assert [r["method"] for r in again["rows"]] == ["dense", "mvue"]
  assert again["rows"][1] == saved["rows"][1] and again["rows"][0]["date"] >= first_dense
  # rows of other budget settings are not mixed in
  _tiny(monkeypatch, "sdgp_table1", width=0.0625, epochs=1, batch_size=8)
  with pytest.warns(RuntimeWarning, match="other budget settings"):
    sdgp_table1.main(["--rows", "dense", "--out", str(tmp_path)])
  assert [r["method"] for r in json.loads((tmp_path / "table1_cpu.json").read_text())["rows"]] == [
    "dense"
  ]


def test_sdgp_fig8_takes_table1s_dense_and_2_4_rows_which_equal_a_fresh_run(
  tmp_path, monkeypatch, tiny_cifar
):
  _tiny(monkeypatch, "sdgp_table1", width=0.0625, epochs=1, batch_size=16)
  _tiny(monkeypatch, "sdgp_fig8", width=0.0625, epochs=1, batch_size=16)
  sdgp_table1.main(["--rows", "dense,rescaled_magnitude", "--out", str(tmp_path)])
  rows = {r["method"]: r for r in json.loads((tmp_path / "table1_cpu.json").read_text())["rows"]}
  fresh = sdgp_fig8.main(
    ["--settings", "2:4", "--no-table1", "--name", "fresh", "--out", str(tmp_path)]
  )["cells"]
  # the claim that makes the reuse honest: the same budget and seed train the same run
  assert [c["test_acc"] for c in fresh] == [
    rows["dense"]["test_acc"],
    rows["rescaled_magnitude"]["test_acc"],
  ]
  assert [c["final_train_loss"] for c in fresh] == [
    rows["dense"]["final_train_loss"],
    rows["rescaled_magnitude"]["final_train_loss"],
  ]
  trained = []
  real_train_row = sdgp_table1.train_row
  monkeypatch.setattr(
    sdgp_table1,
    "train_row",
    lambda method, n, m, *a, **k: trained.append((n, m)) or real_train_row(method, n, m, *a, **k),
  )
  cells = sdgp_fig8.main(["--settings", "1:4,2:4", "--out", str(tmp_path)])["cells"]
  assert trained == [(1, 4)]  # dense and 2:4 came from Table I
  assert {(c["method"], c["n"], c["m"]): c.get("from") for c in cells} == {
    ("dense", 1, 1): "table1",
    ("rescaled_magnitude", 2, 4): "table1",
    ("rescaled_magnitude", 1, 4): None,
  }
  page = (tmp_path / "fig8_cpu.md").read_text()
  assert "Taken from Table I" in page and "3 of 3 runs done" in page
  for link in _links(page):
    assert (tmp_path / link).exists(), link


def _clicktrain_run(method, acc, compression):
  run = {"row": "vgg11", "method": method, "test_acc": acc, "compression": compression}
  run["log"] = f"logs/table1_cpu_vgg11_{method}.jsonl"
  if method == "clicktrain":
    run.update(
      stage="pruned",
      flops_saved={"training": 0.8, "inference": 0.75},
      layer_sparsity={"features/1/conv": 0.7},
      pattern_usage={"3": [[6, 61], [10, 20]]},
      pool=[6, 61],
    )
  return run


def test_clicktrain_page_gathers_saved_rows_beside_the_paper(tmp_path):
  """The page is built from the rows' JSON files (training them is the command's job)."""
  for method, acc, comp in (("dense", 0.80, 1.0), ("clicktrain", 0.78, 9.0)):
    run = _clicktrain_run(method, acc, comp)
    (tmp_path / f"table1_cpu_vgg11_{method}.json").write_text(json.dumps(run))
  args = clicktrain_table1._parse(["--budget", "cpu"])
  page = clicktrain_table1._markdown(args, clicktrain_table1._saved_rows(tmp_path, "cpu"), "cmd")
  rows = {c[0]: c for c in (_cells(line) for line in page.splitlines()) if c[0].startswith("vgg11")}
  # paper (Table 1, VGG-11): base 92.1%, Δ -0.1, 8.6x, 38.5% / 70.0% FLOPs saved
  assert rows["vgg11 dense"][1:3] == ["92.1", "80.00"]
  assert rows["vgg11 ClickTrain"][3:9] == [
    "-0.1",
    "-2.00",
    "8.6x",
    "9.00x",
    "38.5% / 70.0%",
    "80.0% / 75.0%",
  ]
  assert "Budget: `cpu`" in page and "6: 10, 61: 20" in page


def test_clicktrain_page_reads_out_the_hard_prune_of_each_run(tmp_path):
  """The read-out recorded in the epoch before the prune, as a sentence under the row; a run
  without one says so."""
  history = [
    {"epoch": 1, "test_acc": 0.50},
    {
      "epoch": 2,
      "test_acc": 0.60,
      "hard_prune_removed_norm_fraction": 0.125,
      "hard_prune_removed_norm_fraction_by_layer": {"a": 0.05, "b": 0.5, "c": 0.25, "d": 0.0},
      "hard_prune_test_acc_before": 0.6,
      "hard_prune_test_acc_after_no_bn": 0.2,
      "hard_prune_test_acc_after": 0.4567,
    },
    {"epoch": 3, "test_acc": 0.55},
  ]
  for method, acc, comp in (("dense", 0.80, 1.0), ("clicktrain", 0.78, 9.0)):
    run = {**_clicktrain_run(method, acc, comp), "history": history}
    (tmp_path / f"table1_cpu_vgg11_{method}.json").write_text(json.dumps(run))
  args = clicktrain_table1._parse(["--budget", "cpu"])
  page = clicktrain_table1._markdown(args, clicktrain_table1._saved_rows(tmp_path, "cpu"), "cmd")
  assert (
    "- hard-prune read-out (end of epoch 2, just before the prune): the prune removes 12.5% of "
    "the pruned layers' squared weight norm (most from `b` 50.0%, `c` 25.0%, `a` 5.0%); test "
    "accuracy 60.00% before, 20.00% masked, 45.67% masked with BatchNorm re-estimated, 55.00% "
    "at the end of the prune's epoch"
  ) in page.splitlines()
  run = _clicktrain_run("clicktrain", 0.78, 9.0)
  (tmp_path / "table1_cpu_vgg11_clicktrain.json").write_text(json.dumps(run))
  page = clicktrain_table1._markdown(args, clicktrain_table1._saved_rows(tmp_path, "cpu"), "cmd")
  assert "- hard-prune read-out: not in this run's records" in page.splitlines()


def test_clicktrain_page_names_the_command_of_each_saved_run(tmp_path):
  """Rows run by separate invocations share the page: it lists each distinct command once,
  and a run saved without one is credited to this invocation."""
  commands = {"dense": "run --rows vgg11", "clicktrain": "run --rows vgg11 --skip-dense"}
  for method, acc, comp in (("dense", 0.80, 1.0), ("clicktrain", 0.78, 9.0)):
    run = {**_clicktrain_run(method, acc, comp), "command": commands[method]}
    (tmp_path / f"table1_cpu_vgg11_{method}.json").write_text(json.dumps(run))
  resnet = {**_clicktrain_run("dense", 0.79, 1.0), "row": "resnet32"}
  (tmp_path / "table1_cpu_resnet32_dense.json").write_text(json.dumps(resnet))
  args = clicktrain_table1._parse(["--budget", "cpu"])
  page = clicktrain_table1._markdown(args, clicktrain_table1._saved_rows(tmp_path, "cpu"), "cmd")
  assert "- Command: `cmd ; run --rows vgg11 ; run --rows vgg11 --skip-dense`" in page


def _cells(line):
  return [c.strip() for c in line.strip().strip("|").split("|")]


class _Stopped(Exception):
  """Stands for a command killed between epochs."""


# Slow: a row stopped and resumed saves what an uninterrupted row saves (tests/experiments/
# test_rows.py), and a ClickTrain row resumes on the device loader below.
@pytest.mark.slow
def test_clicktrain_row_resumed_after_its_hard_prune_continues_its_checkpoint(
  tmp_path, monkeypatch, tiny_cifar
):
  """``--resume`` is wired through: a ClickTrain run stopped after the epoch of its hard prune
  and continued by the same command with ``--resume`` starts its trainer from that checkpoint
  (stage and masks included: it ends pruned without pruning again), saves the whole history
  and removes its checkpoints. That a resumed run trains exactly what an uninterrupted one
  trains is the trainer's own property, proven where it lives (tests/train/test_resume.py, and
  across ClickTrain's switch in tests/clicktrain/)."""
  from jaxprune import train

  # read-only, as the presets hold a per-family width
  width = MappingProxyType({"vgg": 0.0625})
  _tiny(monkeypatch, "clicktrain_table1", width=width, epochs=5, batch_size=16)
  argv = ["--rows", "vgg11", "--skip-dense", "--out", str(tmp_path)]
  fit, started = train.Trainer.fit, []

  def stop_after_epoch_4(self, *args, epochs, **kwargs):
    fit(self, *args, epochs=min(epochs, 4), **kwargs)
    raise _Stopped

  monkeypatch.setattr(train.Trainer, "fit", stop_after_epoch_4)
  with pytest.raises(_Stopped):
    clicktrain_table1.main(argv)
  checkpoints = tmp_path / "checkpoints" / "table1_cpu_vgg11_clicktrain"
  assert "4" in {p.name for p in checkpoints.iterdir()}
  log = tmp_path / "logs" / "table1_cpu_vgg11_clicktrain.jsonl"
  before = [json.loads(line) for line in log.read_text().splitlines()]
  assert [r["epoch"] for r in before] == [1, 2, 3, 4]
  assert before[-1]["stage"] == "pruned"

  def recording(self, *args, **kwargs):
    started.append(self.epoch)
    return fit(self, *args, **kwargs)

  monkeypatch.setattr(train.Trainer, "fit", recording)
  resumed = clicktrain_table1.main([*argv, "--resume"])["vgg11"]["clicktrain"]
  assert started[0] == 4  # the checkpoint's epoch, not a fresh start
  assert resumed["stage"] == "pruned"
  saved = json.loads((tmp_path / "table1_cpu_vgg11_clicktrain.json").read_text())
  assert [r["epoch"] for r in saved["history"]] == [1, 2, 3, 4, 5]
  # The hard prune (end of epoch 4) is read out at the end of epoch 3, and kept on resume.
  assert [r["epoch"] for r in saved["history"] if "hard_prune_removed_norm_fraction" in r] == [3]
  keys = ("train_loss", "stage", "compression")
  assert [[r[k] for k in keys] for r in saved["history"][:4]] == [
    [r[k] for k in keys] for r in before
  ]
  # the masks came back with the state: the pruned model's compression is kept, not redone
  assert saved["history"][4]["compression"] == pytest.approx(before[-1]["compression"])
  assert not checkpoints.exists()


def test_clicktrain_one_shot_row_switches_to_mixup_after_the_epoch_of_its_hard_prune(
  tmp_path, monkeypatch, tiny_cifar
):
  """The released code trains with mixup after the hard prune: every epoch up to the one whose
  end finds the stage pruned (epoch 4 of 5: max(4, round(0.6 * 5))) sees plain batches."""
  from jaxprune import train

  _tiny(monkeypatch, "clicktrain_table1", width={"vgg": 0.0625}, epochs=5, batch_size=16)
  fit, seen = train.Trainer.fit, []

  def recording(self, loader, *args, epochs, **kwargs):
    start = self.epoch
    history = fit(self, loader, *args, epochs=epochs, **kwargs)
    seen.append((start, self.epoch, loader.augment_name))
    return history

  loader_init = data.Loader.__init__

  def named(self, dataset, batch_size, *args, augment=None, **kwargs):
    loader_init(self, dataset, batch_size, *args, augment=augment, **kwargs)
    self.augment_name = augment

  monkeypatch.setattr(data.Loader, "__init__", named)
  monkeypatch.setattr(train.Trainer, "fit", recording)
  argv = ["--rows", "vgg11", "--skip-dense", "--mode", "one_shot", "--out", str(tmp_path)]
  run = clicktrain_table1.main(argv)["vgg11"]["clicktrain"]
  assert run["stage"] == "pruned"
  plain = [(start, end) for start, end, augment in seen if augment == "clicktrain"]
  assert plain[0][0] == 0 and max(end for _, end in plain) == 4
  assert seen[-1] == (4, 5, "clicktrain-mixup")


class _Built(Exception):
  """Raised where a command builds its trainer: what it set up is checked, nothing trained."""


# Per command: a tiny invocation and the per-epoch log of its first run (None: it keeps none).
_COMMANDS = {
  "clicktrain_table1": (["--rows", "resnet18"], "table1_cpu{}_resnet18_dense.jsonl"),
  "prunetrain_table1": (["--rows", "resnet32"], "table1_cpu{}_resnet32_dense.jsonl"),
  "sdgp_table1": (["--rows", "dense"], "table1_cpu{}_resnet9_dense.jsonl"),
  "sdgp_fig8": (
    ["--settings", "2:4", "--no-dense", "--no-table1"],
    "fig8_cpu{}_resnet9_rescaled_magnitude_2-4.jsonl",
  ),
  "quickstart": (["--methods", "dense", "--epochs", "1", "--batch-size", "16"], None),
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_dtype_reaches_the_model_and_names_a_bf16_run_apart(
  command, dtype, tmp_path, monkeypatch, request
):
  """``--dtype`` is the compute dtype ``models.create`` gets (fp32: the models' default, as
  the published runs); a bf16 run's log and resume configuration say so, an fp32 run's are
  named as before."""
  if command != "quickstart":  # the quickstart's digits ship with scikit-learn
    request.getfixturevalue("tiny_cifar")
  widths = {"clicktrain_table1": MappingProxyType({"resnet": 0.0625})}
  for table in ("clicktrain_table1", "prunetrain_table1", "sdgp_table1", "sdgp_fig8"):
    _tiny(monkeypatch, table, width=widths.get(table, 0.0625), batch_size=16)
  created, built = [], []
  create = models.create

  def recording_create(name, **kwargs):
    created.append(kwargs.get("dtype"))
    return create(name, **kwargs)

  def stop(self, model, tx, **kwargs):
    built.append(kwargs)
    raise _Built

  monkeypatch.setattr(models, "create", recording_create)
  monkeypatch.setattr(train.Trainer, "__init__", stop)
  argv, log = _COMMANDS[command]
  argv = [*argv, "--out", str(tmp_path), *(["--dtype", "bf16"] if dtype == "bf16" else [])]
  with pytest.raises(_Built):
    run_module.load(command)(argv)
  assert created == [None if dtype == "fp32" else jnp.dtype(jnp.bfloat16)]
  (kwargs,) = built
  if log is not None:
    assert Path(kwargs["log_path"]).name == log.format("" if dtype == "fp32" else "_bf16")
  if kwargs.get("run_config") is not None:  # the commands that checkpoint (and resume)
    assert kwargs["run_config"].get("dtype") == (None if dtype == "fp32" else "bf16")
    assert ("_bf16" in str(kwargs["checkpoint_dir"])) == (dtype == "bf16")


def test_sdgp_table1_bf16_run_trains_in_bf16_beside_the_fp32_page(
  tmp_path, monkeypatch, tiny_cifar
):
  """A tiny Table I row at ``--dtype bf16``: trained with a bf16 model, written to its own
  page and JSON (which say so), the fp32 page of the folder left as it was."""
  _tiny(monkeypatch, "sdgp_table1", width=0.0625, epochs=1, batch_size=16)
  fp32 = {"table1_cpu.json": '{"rows": []}', "table1_cpu.md": "the fp32 page\n"}
  for name, text in fp32.items():
    (tmp_path / name).write_text(text)
  dtypes = []
  create = models.create
  monkeypatch.setattr(
    models, "create", lambda name, **kw: dtypes.append(kw.get("dtype")) or create(name, **kw)
  )
  out = sdgp_table1.main(["--rows", "magnitude", "--dtype", "bf16", "--out", str(tmp_path)])
  assert dtypes == [jnp.dtype(jnp.bfloat16)]
  assert {name: (tmp_path / name).read_text() for name in fp32} == fp32
  saved = json.loads((tmp_path / "table1_cpu_bf16.json").read_text())
  assert saved["dtype"] == "bf16" and [r["method"] for r in saved["rows"]] == ["magnitude"]
  assert math.isfinite(out["rows"][0]["final_train_loss"])
  page = (tmp_path / "table1_cpu_bf16.md").read_text()
  assert "- Compute dtype: bf16" in page
  for link in _links(page):
    assert (tmp_path / link).exists() and "_bf16_" in link, link


def test_clicktrain_row_on_the_device_loader_stops_at_its_time_box_and_resumes(
  tmp_path, monkeypatch, tiny_cifar
):
  """``--loader device --max-seconds``: the command stops after the first epoch (the second
  would not fit), writes no result, keeps its checkpoint; ``--resume`` finishes the run, which
  then records its loader, machine and date."""
  _tiny(monkeypatch, "clicktrain_table1", width={"vgg": 0.0625}, epochs=2, batch_size=16)
  argv = ["--rows", "vgg11", "--methods", "dense", "--loader", "device", "--out", str(tmp_path)]
  argv += ["--steps-per-dispatch", "2", "--checkpoint-every", "0"]
  with pytest.warns(RuntimeWarning, match="fit stopped after epoch 1 of 2"):
    out = clicktrain_table1.main([*argv, "--max-seconds", "0.001"])
  assert out == {"stopped": "vgg11 dense"}
  assert not (tmp_path / "table1_cpu_vgg11_dense.json").exists()
  assert (tmp_path / "checkpoints" / "table1_cpu_vgg11_dense" / "1").exists()
  done = clicktrain_table1.main([*argv, "--resume"])["vgg11"]["dense"]
  saved = json.loads((tmp_path / "table1_cpu_vgg11_dense.json").read_text())
  assert done["loader"] == saved["loader"] == "device" and len(saved["history"]) == 2
  assert "Machine" not in saved and saved["machine"] and saved["date"]


@pytest.mark.parametrize(
  "flags, match",
  [
    (["--eval-every", "0"], "--eval-every"),
    (["--steps-per-dispatch", "0"], "--steps-per-dispatch"),
    (["--must-finish"], "--must-finish needs --max-seconds"),
    (["--max-seconds", "-1"], "--max-seconds"),
  ],
)
def test_run_options_are_checked_by_name(flags, match):
  with pytest.raises(ValueError, match=match):
    clicktrain_table1._parse(["--budget", "cpu", *flags])


def test_compile_cache_flag_turns_the_persistent_cache_on(tmp_path, monkeypatch):
  import jax

  monkeypatch.setenv("JAXPRUNE_COMPILE_CACHE", str(tmp_path / "cache"))
  before = jax.config.jax_compilation_cache_dir
  try:
    args = clicktrain_table1._parse(["--budget", "cpu", "--compile-cache", "on"])
    assert args.options.compile_cache == str((tmp_path / "cache").resolve())
    assert jax.config.jax_compilation_cache_dir == args.options.compile_cache
    off = clicktrain_table1._parse(["--budget", "cpu"])  # auto: off on a CPU
    assert off.options.compile_cache == "auto"
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()

"""ClickTrain Table 1 builds ClickTrain through the registered preset, and what reaches
``clicktrain`` is what the published runs trained with (the command called it directly then)."""

import functools
import inspect
import json
import re
from pathlib import Path

import numpy as np
import optax
import pytest

from experiments.clicktrain import table1 as clicktrain_table1
from experiments.clicktrain import transition_options
from jaxprune import methods
from jaxprune.clicktrain import Schedule, preset
from jaxprune.clicktrain.layer_choice import checked_default_layer_filter

RESULTS = Path(__file__).resolve().parents[2] / "experiments" / "results" / "clicktrain"

# The hard-prune epoch of each row at the paper budget: Table 1's last column, and half of the
# 190 epochs for ResNet-18, which is not in the table.
_PAPER_HARD = {"resnet32": 98, "resnet50": 95, "vgg11": 96, "vgg13": 95, "resnet18": 95}


def _before(budget: str, row: str, mode: str) -> dict:
  """The stage epochs the command passed to ``clicktrain.clicktrain`` before it used the preset
  (written out: cpu = 12 epochs, stages of one epoch, hard prune at round(0.6 * 12) = 7; paper
  = the released code's mask pick 30 epochs before the hard prune)."""
  if budget == "cpu":
    if mode == "one_shot":
      return {"hard_prune_epoch": 7, "one_shot_epoch": 1}
    return {"pool_start_epoch": 1, "pool_epochs": 1, "finalize_epochs": 1, "hard_prune_epoch": 7}
  hard = _PAPER_HARD[row]
  if mode == "one_shot":
    return {"hard_prune_epoch": hard, "one_shot_epoch": hard - 30}
  return {
    "pool_start_epoch": None,
    "pool_epochs": 5,
    "finalize_epochs": 5,
    "hard_prune_epoch": hard,
  }


@pytest.fixture
def clicktrain_calls(monkeypatch):
  """The keyword arguments of every ``clicktrain(...)`` the preset builds during the test."""
  calls = []
  real = preset.clicktrain

  @functools.wraps(real)
  def recording(inner, **kwargs):
    calls.append(kwargs)
    return real(inner, **kwargs)

  monkeypatch.setattr(preset, "clicktrain", recording)
  return calls


@pytest.mark.parametrize("budget", ["cpu", "paper"])
@pytest.mark.parametrize("mode", ["paper", "one_shot"])
@pytest.mark.parametrize("row", sorted(_PAPER_HARD))
def test_preset_reaches_clicktrain_with_the_arguments_the_published_runs_used(
  clicktrain_calls, budget, mode, row
):
  real = inspect.unwrap(preset.clicktrain)
  args = clicktrain_table1._parse(["--budget", budget, "--mode", mode, "--rows", row])
  inner = optax.sgd(0.1)
  clicktrain_table1._method(args, row).make_tx(inner, methods.Run(390, args.recipe.epochs))
  (kwargs,) = clicktrain_calls
  # The epoch settings arrive as one Schedule; the run's length in it only checks the schedule
  # (no training setting): the published runs were built before the transform took it.
  schedule = kwargs.pop("schedule")
  assert schedule.total_epochs == args.recipe.epochs
  before = {k: v for k, v in _before(budget, row, mode).items() if v is not None}
  assert schedule == Schedule(390, mode=mode, total_epochs=args.recipe.epochs, **before)
  got = inspect.signature(real).bind(inner, **kwargs)
  got.apply_defaults()
  ratio = got.arguments.pop("kernel_prune_ratio")
  expected = inspect.signature(real).bind(inner, kernel_prune_ratio=ratio)
  expected.apply_defaults()
  expected.arguments.pop("kernel_prune_ratio")
  # The preset passes the name rule itself (its fit-start check compares it with the
  # structure): the same choice as the default the published runs took.
  assert got.arguments.pop("layer_filter") is checked_default_layer_filter
  assert expected.arguments.pop("layer_filter") is None
  assert got.arguments == expected.arguments
  # the per-layer ratios of the authors' released code (VGG-11; ResNet-32 by stage)
  if row == "vgg11":
    released = [0.35, 0.45, 0.65, 0.75, 0.80, 0.80, 0.85]
    assert [ratio(f"features/{i}/conv/kernel", None) for i in range(1, 8)] == released
  if row == "resnet32":
    assert [ratio(f"stages/{s}/0/conv1/kernel", None) for s in range(3)] == [0.55, 0.65, 0.75]


def test_stage_epochs_depend_on_the_row_only_in_the_paper_budget():
  cpu = clicktrain_table1._parse(["--budget", "cpu"])
  epochs = [clicktrain_table1._stage_epochs(cpu, row) for row in _PAPER_HARD]
  assert all(e == epochs[0] for e in epochs)
  paper = clicktrain_table1._parse(["--budget", "paper"])
  assert clicktrain_table1._stage_epochs(paper, "vgg11")["hard_prune_epoch"] == 96
  # not a Table 1 row: the preset places the hard prune
  assert "hard_prune_epoch" not in clicktrain_table1._stage_epochs(paper, "resnet18")


def test_published_page_is_rebuilt_from_its_saved_rows():
  """The page code reads the hard-prune epoch off each run's history; from the published JSON
  it writes the published page again (the date and machine aside)."""
  args = clicktrain_table1._parse(["--budget", "cpu"])
  rebuilt = clicktrain_table1._markdown(args, clicktrain_table1._saved_rows(RESULTS, "cpu"), "-")
  published = (RESULTS / "table1_cpu.md").read_text()

  def stable(page):
    return [line for line in page.splitlines() if not re.match(r"- (Date|Machine):", line)]

  assert stable(rebuilt) == stable(published)
  assert published.count("hard prune at epoch 7;") == 4


def test_filter_groups_reach_clicktrain_and_the_aligned_page(clicktrain_calls, tmp_path):
  calls = clicktrain_calls
  args = clicktrain_table1._parse(["--budget", "cpu", "--rows", "vgg11", "--filter-groups", "2"])
  clicktrain_table1._method(args, "vgg11").make_tx(
    optax.sgd(0.1), methods.Run(390, args.recipe.epochs)
  )
  assert calls[0]["filter_groups"] == 2
  assert calls[0]["filter_grouping"] == "consecutive"
  # The page: the aligned run beside the row's dense and fine-grained runs, epoch times after
  # the prune compared with the dense run's.
  for method in ("dense", "clicktrain"):
    name = f"table1_cpu_vgg11_{method}.json"
    (tmp_path / name).write_text((RESULTS / name).read_text())
  aligned = json.loads((RESULTS / "table1_cpu_vgg11_clicktrain.json").read_text())
  for record in aligned["history"]:
    record["epoch_time_s"] = 10.0
  aligned["history"][5]["hard_prune_removed_norm_fraction"] = 0.25  # read out before the prune
  aligned["test_acc"] = 0.5
  (tmp_path / "table1_cpu_vgg11_aligned-g2.json").write_text(json.dumps(aligned))
  page = clicktrain_table1.aligned_markdown(tmp_path, "cpu")
  main = page.split("\n## ")[0]
  rows = [line for line in main.splitlines() if line.startswith("| vgg11 |")]
  assert [r.split(" | ")[1] for r in rows] == [
    "paper: ClickTrain (fine-grained, 190 epochs)",
    "dense",
    "clicktrain",
    "aligned-g2",
  ]
  assert "| 92.0% | -0.1 |" in rows[0]  # Table 1: 92.1 base, -0.1
  dense = json.loads((RESULTS / "table1_cpu_vgg11_dense.json").read_text())
  fine = json.loads((RESULTS / "table1_cpu_vgg11_clicktrain.json").read_text())
  assert "| 10 / 10 | 1.00× |" in rows[3]  # every epoch 10 s: after / before = 1
  # The read-outs: test accuracy at the end of the prune's epoch, the norm share the prune
  # removes (where the run recorded it), the last epoch's train loss.
  at = next(h for h in fine["history"] if h["stage"] == "pruned")
  last = fine["history"][-1]["train_loss"]
  assert f"| {100 * at['test_acc']:.2f}% | 25.0% | {last:.3f} |" in rows[3]
  assert f"| {100 * at['test_acc']:.2f}% | – | {last:.3f} |" in rows[2]
  assert (
    f"| {100 * (0.5 - dense['test_acc']):+.2f} | {100 * (0.5 - fine['test_acc']):+.2f} |" in rows[3]
  )
  # Against the targets: the one aligned run is the best with G <= 8, 50% against the fine-grained
  # run's accuracy; it misses, so the page gives the training losses behind it.
  targets = page.split("## Against the targets")[1].split("## Time to accuracy")[0]
  delta = 100 * (0.5 - fine["test_acc"])
  assert f"| vgg11 | G ≤ 8 within 1 point | aligned-g2 | {delta:+.2f} (1) | no |" in targets
  assert "| vgg11 | G = 1 within" not in targets  # no G = 1 run
  loss = aligned["history"][-1]["train_loss"]
  assert f"training loss of {loss:.3f}–{loss:.3f}, the fine-grained run at {last:.3f}" in targets
  # Time to accuracy, each run in its own dense-speed epochs: the aligned run's 12 epochs of
  # 10 s against its 10 s before the prune cost 12 of them; the dense run's unit is the mean of
  # its epochs 2..12 (the first compiles).
  times = page.split("## Time to accuracy")[1].split("Commands:")[0]
  cost = {
    line.split(" | ")[1]: line.split(" | ")[5:7]
    for line in times.splitlines()
    if line.startswith("| vgg11 |")
  }
  epochs = [h["epoch_time_s"] for h in dense["history"]]
  dense_cost = sum(epochs) / (sum(epochs[1:]) / len(epochs[1:]))
  assert cost["dense"] == [f"{dense_cost:.2f}", "1.00× |"]
  assert cost["aligned-g2"] == ["12.00", f"{12 / dense_cost:.2f}× |"]
  assert (tmp_path / "table1-aligned_cpu_vgg11_time.png").stat().st_size > 0


def test_transition_options_reach_clicktrain_the_schedule_and_the_run_name(clicktrain_calls):
  """--group-lasso-ramp and --prune-window-epochs reach clicktrain(); --lr-rewind-epoch
  rewinds the row's LR schedule after its hard prune (epoch 7 at the cpu budget); the run is
  named with a suffix per option, in a fixed order."""
  calls = clicktrain_calls
  argv = ["--budget", "cpu", "--filter-groups", "1", "--group-lasso-ramp", "cubic"]
  argv += ["--prune-window-epochs", "2", "--lr-rewind-epoch", "3"]
  args = clicktrain_table1._parse(argv)
  clicktrain_table1._method(args, "vgg11").make_tx(
    optax.sgd(0.1), methods.Run(10, args.recipe.epochs)
  )
  assert (calls[0]["group_lasso_ramp"], calls[0]["schedule"].prune_window_epochs) == ("cubic", 2)
  assert transition_options.suffix(args) == "-rampc-win2-rw3"
  assert transition_options.suffix(clicktrain_table1._parse([])) == ""
  rewound = clicktrain_table1._schedule(args, "vgg11", 10, prune=True)
  plain = clicktrain_table1._schedule(args, "vgg11", 10, prune=False)
  # Epoch 7 ends with the prune: the LR goes back to epoch 3's (0.1, before the drop at 6).
  assert float(plain(69)) == float(rewound(69)) == pytest.approx(0.01)
  assert float(rewound(70)) == pytest.approx(0.1) and float(plain(70)) == pytest.approx(0.01)
  assert float(rewound(120)) == pytest.approx(float(plain(120)))  # the schedule's end


def test_hard_prune_epoch_moves_the_prune_and_the_rewind_and_is_checked(clicktrain_calls):
  """--hard-prune-epoch replaces the cpu budget's share (epoch 7 of 12): the schedule the
  transform gets, the LR rewind's epoch and the run name follow it; a value outside the stages
  or the run, or on the paper budget, stops the command."""
  argv = ["--budget", "cpu", "--filter-groups", "8", "--hard-prune-epoch", "9"]
  args = clicktrain_table1._parse([*argv, "--lr-rewind-epoch", "3"])
  clicktrain_table1._method(args, "vgg11").make_tx(
    optax.sgd(0.1), methods.Run(10, args.recipe.epochs)
  )
  assert clicktrain_calls[0]["schedule"].hard_prune_epoch == 9
  assert transition_options.suffix(args) == "-rw3-hp9"
  rewound = clicktrain_table1._schedule(args, "vgg11", 10, prune=True)
  assert float(rewound(89)) == pytest.approx(0.01)  # epoch 9 ends with the prune
  assert float(rewound(90)) == pytest.approx(0.1)  # back to epoch 3's
  for bad in (["--hard-prune-epoch", "3"], ["--hard-prune-epoch", "12"]):
    with pytest.raises(SystemExit):
      clicktrain_table1._parse(["--budget", "cpu", *bad])
  with pytest.raises(SystemExit):
    clicktrain_table1._parse(["--budget", "paper", "--hard-prune-epoch", "90"])


def test_clustered_filter_grouping_reaches_clicktrain_and_the_aligned_page(
  clicktrain_calls, tmp_path
):
  calls = clicktrain_calls
  argv = ["--budget", "cpu", "--rows", "vgg11", "--filter-groups", "2"]
  args = clicktrain_table1._parse([*argv, "--filter-grouping", "clustered"])
  clicktrain_table1._method(args, "vgg11").make_tx(
    optax.sgd(0.1), methods.Run(390, args.recipe.epochs)
  )
  assert (calls[0]["filter_groups"], calls[0]["filter_grouping"]) == (2, "clustered")
  with pytest.raises(SystemExit):
    clicktrain_table1._parse(["--budget", "cpu", "--filter-grouping", "clustered"])
  # The page lists the runs by G (16 after 2), the clustered after the consecutive of one G.
  for method in ("dense", "clicktrain"):
    name = f"table1_cpu_vgg11_{method}.json"
    (tmp_path / name).write_text((RESULTS / name).read_text())
  for method in ("aligned-g16", "aligned-g2c", "aligned-g2"):
    (tmp_path / f"table1_cpu_vgg11_{method}.json").write_text(
      (RESULTS / "table1_cpu_vgg11_clicktrain.json").read_text()
    )
  page = clicktrain_table1.aligned_markdown(tmp_path, "cpu")
  main = page.split("\n## ")[0]
  rows = [line for line in main.splitlines() if line.startswith("| vgg11 |")]
  assert [r.split(" | ")[1] for r in rows][1:] == [
    "dense",
    "clicktrain",
    "aligned-g2",
    "aligned-g2c",
    "aligned-g16",
  ]


def test_runs_of_other_seeds_go_to_the_aligned_pages_seeds_table(tmp_path):
  """A ``--seed 1`` run is named ``..._seed1``: the main aligned table and the Table 1 page read
  seed 0 only, and the seeds table gives each method run under another seed its accuracy per
  seed, the mean, and the mean of the seed-by-seed differences to the fine-grained run."""
  assert clicktrain_table1._parse(["--seed", "1"]).seed == 1
  fine = json.loads((RESULTS / "table1_cpu_vgg11_clicktrain.json").read_text())
  accs = {
    ("dense", 0): 0.80,
    ("clicktrain", 0): 0.70,
    ("clicktrain", 1): 0.72,
    ("aligned-g2", 0): 0.65,
    ("aligned-g2", 1): 0.69,
    ("aligned-g4", 1): 0.60,
  }
  stems = {}
  for (method, seed), acc in accs.items():
    stem = clicktrain_table1.aligned_page.run_stem("cpu", "vgg11", method, seed)
    stems[method, seed] = stem
    note = {"note": "timed under load"} if method == "aligned-g4" else {}
    (tmp_path / f"{stem}.json").write_text(json.dumps({**fine, "test_acc": acc, **note}))
  assert stems["aligned-g2", 0] == "table1_cpu_vgg11_aligned-g2"
  assert stems["aligned-g2", 1] == "table1_cpu_vgg11_aligned-g2_seed1"
  assert set(clicktrain_table1._saved_rows(tmp_path, "cpu")["vgg11"]) == {"dense", "clicktrain"}
  assert clicktrain_table1._saved_rows(tmp_path, "cpu")["vgg11"]["clicktrain"]["test_acc"] == 0.70

  page = clicktrain_table1.aligned_markdown(tmp_path, "cpu")
  main, seeds = page.split("## Against the targets")[0].split("## Over seeds")
  rows = [line for line in main.splitlines() if line.startswith("| vgg11 |")]
  assert [r.split(" | ")[1] for r in rows][1:] == ["dense", "clicktrain", "aligned-g2"]
  assert "| 65.00% | -15.00 | -5.00 |" in rows[3]
  seed_rows = {
    line.split(" | ")[1]: line.split(" | ")[2:]
    for line in seeds.splitlines()
    if line.startswith("| vgg11 |")
  }
  assert "dense" not in seed_rows  # seed 0 only: in the main table
  assert seed_rows["clicktrain"] == ["70.00%", "72.00%", "71.00%", "– |"]
  # (65 - 70) and (69 - 72): a mean of -4 points over two seeds
  assert seed_rows["aligned-g2"] == ["65.00%", "69.00%", "67.00%", "-4.00 (2) |"]
  assert seed_rows["aligned-g4"] == ["–", "60.00%", "60.00%", "-12.00 (1) |"]
  assert "- vgg11 aligned-g4 seed 1: `" in page
  assert [line for line in page.splitlines() if "(timed under load)" in line] == [
    f"- vgg11 aligned-g4 seed 1: `{fine['command']}` (timed under load)"
  ]


def test_layer_read_outs_count_zero_weights_and_live_input_channels():
  """Per conv: the fraction of zero weights, and of input channels some filter still reads
  (hand-counted on a 3x3, 4-in, 2-out kernel with channels 1 and 3 pruned for both filters)."""
  kernel = np.ones((3, 3, 4, 2), np.float32)
  kernel[:, :, 1, :] = 0
  kernel[:, :, 3, 0] = 0
  kernel[:, :, 3, 1] = 0
  kernel[0, 0, 2, 1] = 0
  params = {"features": {"1": {"conv": {"kernel": kernel, "bias": np.ones(2)}}}}
  assert clicktrain_table1._layer_sparsity(params) == {"features/1/conv": (36 + 1) / 72}
  assert clicktrain_table1._live_inputs(params, (0, 1, 3)) == {"features/1/conv": 0.5}
  # (tap, channel) pairs: channels 0 and 2 at all 9 taps (filter 0 reads (0, 0, 2))
  assert clicktrain_table1._live_inputs(params, (3,)) == {"features/1/conv": 18 / 36}
  kernel[0, 0, 2, 0] = 0
  assert clicktrain_table1._live_inputs(params, (3,)) == {"features/1/conv": 17 / 36}


def _old_ratio(row: str, path: str) -> float:
  """The ratio the table command gave a layer before the ratios moved into the preset, written
  out from its literal lists: VGG by the conv's index (the stem, 0, never pruned), ResNet by
  stage."""
  index = int(path.split("/")[1])
  if row == "vgg11":
    return [0.35, 0.45, 0.65, 0.75, 0.80, 0.80, 0.85][index - 1]
  if row == "vgg13":
    return [0.35, 0.40, 0.45, 0.55, 0.65, 0.75, 0.80, 0.80, 0.85][index - 1]
  return (0.55, 0.65)[index] if index < 2 else 0.75


@pytest.mark.parametrize("row", ["vgg11", "vgg13", "resnet32"])
def test_every_pruned_layer_keeps_the_ratio_the_table_gave_it_before(row):
  """The table's method and the benches' ``paper_kernel_ratios`` give each pruned conv of the
  row's model the ratio of the old literal lists."""
  import jax
  from flax import nnx

  from jaxprune import models
  from jaxprune.clicktrain.config import default_layer_filter
  from jaxprune.paths import path_string

  model = nnx.eval_shape(
    lambda: models.create(f"clicktrain-{row}", num_classes=10, rngs=nnx.Rngs(0))
  )
  leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  pruned = [
    (path_string(p), leaf.shape)
    for p, leaf in leaves
    if default_layer_filter(path_string(p), leaf.shape)
  ]
  assert len(pruned) >= 7
  table = clicktrain_table1._method(clicktrain_table1._parse([]), row).config["kernel_prune_ratio"]
  bench = preset.paper_kernel_ratios(f"clicktrain-{row}")
  for path, shape in pruned:
    assert table(path, shape) == bench(path, shape) == _old_ratio(row, path), path


def test_fine_grained_runs_with_options_and_the_specialised_step_on_the_aligned_page(tmp_path):
  """A fine-grained run with a transition option (``clicktrain-rw3``) stays off the Table 1
  page and sits on the aligned page after the plain fine-grained run, with its difference to it;
  the targets section gives the fine-grained mean against the published accuracy, names a
  combination of options mark by mark, and reports the epochs after the prune of the runs with
  the pruned stage's specialised step apart from the plain runs'."""
  on_page = clicktrain_table1._on_table1_page
  assert on_page(clicktrain_table1._parse([]), prune=True)
  assert not on_page(clicktrain_table1._parse(["--lr-rewind-epoch", "3"]), prune=True)
  assert on_page(clicktrain_table1._parse(["--lr-rewind-epoch", "3"]), prune=False)  # dense
  assert not on_page(clicktrain_table1._parse(["--seed", "1"]), prune=False)
  assert not on_page(clicktrain_table1._parse(["--filter-groups", "8"]), prune=True)

  fine = json.loads((RESULTS / "table1_cpu_vgg11_clicktrain.json").read_text())
  at = next(h["epoch"] for h in fine["history"] if h["stage"] == "pruned")

  def run(acc, after_s, specialised=False):
    history = [
      {
        **h,
        "epoch_time_s": 10.0 if h["epoch"] <= at else after_s,
        **({"ct_pruned_step": h["epoch"] >= at} if specialised else {}),
      }
      for h in fine["history"]
    ]
    return {**fine, "test_acc": acc, "history": history}

  runs = {
    ("dense", 0): run(0.80, 10.0),
    ("clicktrain", 0): run(0.70, 10.0),
    ("clicktrain", 1): run(0.71, 10.0),
    ("clicktrain-rw3", 0): run(0.715, 10.0),
    ("aligned-g8", 0): run(0.66, 7.0),
    ("aligned-g8-rw3", 0): run(0.68, 7.0),
    ("aligned-g8-rw3-hp9", 0): run(0.67, 6.0, specialised=True),
  }
  for (method, seed), saved in runs.items():
    stem = clicktrain_table1.aligned_page.run_stem("cpu", "vgg11", method, seed)
    (tmp_path / f"{stem}.json").write_text(json.dumps(saved))
  assert set(clicktrain_table1._saved_rows(tmp_path, "cpu")["vgg11"]) == {"dense", "clicktrain"}
  page = clicktrain_table1.aligned_markdown(tmp_path, "cpu")
  main, targets = page.split("## Over seeds")[0], page.split("## Against the targets")[1]
  rows = [line for line in main.splitlines() if line.startswith("| vgg11 |")]
  assert [r.split(" | ")[1] for r in rows][1:] == [
    "dense",
    "clicktrain",
    "clicktrain-rw3",
    "aligned-g8",
    "aligned-g8-rw3",
    "aligned-g8-rw3-hp9",
  ]
  assert "| 71.50% | -8.50 | +1.50 |" in rows[3]  # against the seed-0 fine-grained 70%
  assert "| 70.00% | -10.00 | – |" in rows[2]
  assert "| vgg11 | clicktrain | 70.50% (2) | – |" in targets
  assert "| vgg11 | clicktrain-rw3 (LR rewinding to epoch 3) | 71.50% (1) | +1.50 (1) |" in targets
  # 70.5 is 0.2 below the published 70.7: within the point.
  assert "The fine-grained mean, 70.50% over 2 seed(s), against the 70.7% published" in targets
  assert "point below): met." in targets
  assert "| vgg11 | LR rewinding to epoch 3 + hard prune after epoch 9 | – | -3.00 (1) |" in targets
  # Like for like: aligned-g8-rw3 (68%) against clicktrain-rw3 (71.5%), not the plain 70%.
  assert "with the same option, the aligned runs with it stand at `rw3` G = 8 -3.50 (1)." in targets
  assert (
    "the runs without options, general step: aligned-g8 0.70×; with the pruned stage's "
    "specialised step: aligned-g8-rw3-hp9 0.60×." in targets
  )
  # Whether the budget lets the networks fit: the dense run's last record, and the widest
  # train-over-test gap of the seed-0 runs (every run here ends at the fine run's training
  # accuracy; the least accurate test is aligned-g8's 66%).
  last = fine["history"][-1]
  assert (
    f"The dense run itself ends at a training loss of {last['train_loss']:.3f} (training "
    f"accuracy over its last epoch, augmented, {100 * last['train_acc']:.1f}%; test 80.0%), and "
    f"no run's training accuracy is more than {100 * last['train_acc'] - 66:.1f} points above"
  ) in targets

"""The table commands' shared plumbing: named budgets, output folders, results pages, links."""

import argparse
import json
import re
from pathlib import Path

import jax.numpy as jnp
import pytest

from experiments.benchmarks import quickstart
from experiments.clicktrain import table1 as clicktrain_table1
from experiments.common import budgets, cli, pages, run_options
from experiments.prunetrain import table1 as prunetrain_table1
from experiments.sdgp import fig8 as sdgp_fig8
from experiments.sdgp import table1 as sdgp_table1
from experiments.sdgp import timemodel as sdgp_timemodel

REPO = Path(__file__).resolve().parents[2]


# The paper's recipe per table, read off the papers (ClickTrain §6.1, PruneTrain §5, the ffcv
# ResNet-9 recipe SDGP ran, SDGP Fig. 10's 94.5% target), written out here independently of
# experiments/common/budgets.py.
PAPER_RECIPES = {
  "clicktrain_table1": {"epochs": 190, "batch_size": 128, "width": 1.0, "train_subset": None},
  "prunetrain_table1": {
    "epochs": 182,
    "batch_size": 128,
    "width": 1.0,
    "penalty_ratio": 0.2,
    "threshold": 1e-4,
    "interval": 10,
    "milestones": (0.5, 0.75),
  },
  "sdgp_table1": {"epochs": 150, "batch_size": 512, "width": 1.0, "peak_lr": 0.5},
  "sdgp_fig8": {"epochs": 150, "batch_size": 512, "width": 1.0, "peak_lr": 0.5},
  "sdgp_timemodel": {"batch_size": 512, "width": 1.0, "target_acc": 0.945},
}


@pytest.mark.parametrize("table", sorted(PAPER_RECIPES))
def test_paper_budget_is_the_papers_recipe(table):
  budget = budgets.get_budget(table, "paper")
  for key, value in PAPER_RECIPES[table].items():
    assert budget[key] == value, key


@pytest.mark.parametrize("table", sorted(budgets.BUDGETS))
def test_cpu_budget_is_reduced_over_the_full_training_set(table):
  paper, cpu = budgets.get_budget(table, "paper"), budgets.get_budget(table, "cpu")
  assert set(cpu) == set(paper)  # the same knobs, other values
  for family in ("resnet", "vgg"):
    assert budgets.row_width(cpu["width"], family) < budgets.row_width(paper["width"], family)
  if "epochs" in cpu:
    assert cpu["epochs"] < paper["epochs"]
    # reduced width over the full training set, not a subset
    assert cpu["train_subset"] is None and cpu["test_subset"] is None


def test_row_width_is_the_budgets_number_or_the_rows_family():
  assert budgets.row_width(0.5, "vgg11") == 0.5
  by_family = {"resnet": 0.125, "vgg": 0.25}
  assert budgets.row_width(by_family, "vgg13") == 0.25
  assert budgets.row_width(by_family, "resnet50") == 0.125
  with pytest.raises(ValueError, match="'mobilenet'"):
    budgets.row_width(by_family, "mobilenet")
  line = budgets.describe_budget({"width": by_family, "epochs": 2, "batch_size": 8})
  assert line.startswith("width resnet ×0.125 / vgg ×0.25, ")


def test_clicktrain_cpu_rows_cost_about_the_same():
  # The per-family widths exist so that every dense row of the cpu table costs about the same
  # (20-41 MFLOPs per image): checked by tracing the real models.
  from flax import nnx

  from jaxprune import flops, models

  width = budgets.get_budget("clicktrain_table1", "cpu")["width"]
  for row in ("vgg11", "vgg13", "resnet32", "resnet50"):
    model = models.create(
      f"clicktrain-{row}",
      num_classes=10,
      rngs=nnx.Rngs(0),
      width_multiplier=budgets.row_width(width, row),
    )
    mflops = flops.inference_flops(model, (1, 32, 32, 3)) / 1e6
    assert 15 < mflops < 45, (row, mflops)


def test_sdgp_figure_trains_with_table_one_budget():
  for name in ("paper", "cpu"):
    assert budgets.get_budget("sdgp_fig8", name) == budgets.get_budget("sdgp_table1", name)


def test_unknown_budget_or_table_is_a_value_error_naming_it():
  with pytest.raises(ValueError, match="'gpu'"):
    budgets.get_budget("sdgp_table1", "gpu")
  with pytest.raises(ValueError, match="'nope'"):
    budgets.get_budget("nope", "cpu")


def test_budget_is_read_only():
  budget = budgets.get_budget("prunetrain_table1", "cpu")
  with pytest.raises(TypeError):
    budget["epochs"] = 1
  assert budgets.get_budget("prunetrain_table1", "cpu")["epochs"] != 1


@pytest.mark.parametrize("budget", ["paper", "cpu"])
def test_every_row_of_a_table_gets_the_same_budget(budget):
  """The row is a separate argument: parsing with different rows changes nothing else."""
  ct = [
    vars(clicktrain_table1._parse(["--budget", budget, "--rows", r]))
    for r in clicktrain_table1.PAPER
  ]
  for args in ct:
    assert {k: v for k, v in args.items() if k != "rows"} == {
      k: v for k, v in ct[0].items() if k != "rows"
    }
  assert all(args["recipe"] == budgets.get_budget("clicktrain_table1", budget) for args in ct)
  pt = prunetrain_table1._parse(["--budget", budget, "--rows", ",".join(prunetrain_table1.ROWS)])
  assert pt.recipe == budgets.get_budget("prunetrain_table1", budget)
  # one argument set for every SDGP row, so every row trains with one budget
  sd = sdgp_table1._parse(["--budget", budget])
  assert sd.recipe == budgets.get_budget("sdgp_table1", budget)


def test_bad_budget_name_on_the_command_line_is_rejected():
  for parse in (clicktrain_table1._parse, prunetrain_table1._parse, sdgp_table1._parse):
    with pytest.raises(SystemExit):
      parse(["--budget", "full"])


def test_output_goes_to_scratch_unless_published(tmp_path, monkeypatch):
  monkeypatch.setattr(pages, "SCRATCH", tmp_path / "runs")
  monkeypatch.setattr(pages, "RESULTS", tmp_path / "results")
  assert pages.output_dir("sdgp") == tmp_path / "runs" / "sdgp"
  assert pages.output_dir("sdgp", publish=True) == tmp_path / "results" / "sdgp"
  assert pages.output_dir(None, publish=True) == tmp_path / "results"
  assert pages.output_dir("sdgp", publish=True, out=tmp_path / "x") == tmp_path / "x"
  assert (tmp_path / "runs" / "sdgp").is_dir() and (tmp_path / "x").is_dir()
  with pytest.raises(ValueError, match="'sgdp'"):
    pages.output_dir("sgdp")


def test_default_locations_are_the_repository_folders():
  assert pages.RESULTS == REPO / "experiments" / "results"
  assert pages.SCRATCH == REPO / "runs"
  ignored = (REPO / ".gitignore").read_text().splitlines()
  assert "runs/" in ignored


@pytest.mark.parametrize(
  "parse", [clicktrain_table1._parse, prunetrain_table1._parse, sdgp_fig8._parse]
)
def test_table_commands_publish_only_when_asked(parse):
  assert parse([]).publish is False
  assert parse(["--publish"]).publish is True


def test_timemodel_and_quickstart_take_the_output_flags():
  assert sdgp_timemodel._parse(["--publish"]).publish
  assert quickstart._parse([]).publish is False


def test_dtype_argument_maps_its_names_to_the_models_compute_dtype():
  parser = argparse.ArgumentParser()
  cli.add_dtype_argument(parser)
  fp32, bf16 = parser.parse_args([]), parser.parse_args(["--dtype", "bf16"])
  assert (fp32.dtype, bf16.dtype) == ("fp32", "bf16")
  # fp32 is the models' own float32 default (None), as the published runs created them.
  assert cli.compute_dtype(fp32) is None
  assert cli.compute_dtype(bf16) == jnp.dtype(jnp.bfloat16)
  assert cli.compute_dtype("bf16") == jnp.dtype(jnp.bfloat16)
  assert cli.compute_dtype(argparse.Namespace()) is None  # a namespace without the flag
  # fp32 names and saved configurations stay as they were; bf16 ones are marked.
  assert (cli.dtype_suffix(fp32), cli.dtype_suffix(bf16)) == ("", "_bf16")
  assert (cli.dtype_config(fp32), cli.dtype_config(bf16)) == ({}, {"dtype": "bf16"})
  assert cli.dtype_notes(fp32) == [] and "bfloat16" in cli.dtype_notes(bf16)[0]
  with pytest.raises(SystemExit):
    parser.parse_args(["--dtype", "fp16"])
  with pytest.raises(ValueError, match="dtype"):
    cli.compute_dtype("fp16")


@pytest.mark.parametrize(
  "parse",
  [
    clicktrain_table1._parse,
    prunetrain_table1._parse,
    sdgp_table1._parse,
    sdgp_fig8._parse,
    quickstart._parse,
  ],
)
def test_training_commands_take_the_dtype(parse):
  assert parse([]).dtype == "fp32"
  assert parse(["--dtype", "bf16"]).dtype == "bf16"


def test_quickstart_page_states_command_and_table(tmp_path):
  rows = [
    {"method": "dense", "test_acc": 0.9, "compression": 1.0, "train_time_s": 3.0, "epochs": 2},
    {"method": "clicktrain", "test_acc": 0.8, "compression": 4.0, "train_time_s": 5.0, "epochs": 2},
  ]
  page = quickstart.write_page(
    tmp_path, rows, "python -m experiments.run quickstart", quickstart._parse([])
  )
  text = page.read_text()
  assert "`python -m experiments.run quickstart`" in text and "- Machine:" in text
  assert "| clicktrain | 80.00% | 4.00x | 5.0 |" in text
  assert "Compute dtype" not in text
  bf16 = quickstart.write_page(tmp_path, rows, "cmd", quickstart._parse(["--dtype", "bf16"]))
  assert bf16.name == "quickstart_bf16.md" and page.read_text() == text  # beside, not over it
  assert "- Compute dtype: bf16" in bf16.read_text()


def _cells(line):
  return [c.strip() for c in line.strip().strip("|").split("|")]


def test_saved_result_compares_the_budget_in_the_form_it_was_saved(tmp_path):
  budget = {"epochs": 10, "width": 0.125, "milestones": (5, 8)}
  assert pages.saved_result(tmp_path / "t", budget) == (None, False)
  (tmp_path / "t.json").write_text(json.dumps({"budget": budget, "rows": [1]}))
  saved, same = pages.saved_result(tmp_path / "t", budget)
  assert same and saved["rows"] == [1]  # the tuple came back as a list and still matches
  assert not pages.saved_result(tmp_path / "t", {**budget, "epochs": 11})[1]


def test_every_preset_has_a_saved_form_that_json_round_trips():
  # The presets are read-only (a per-family width too); runs store them in JSON and in
  # checkpoints' run_config, which must compare equal after a round trip.
  for table, table_budgets in budgets.BUDGETS.items():
    for name in table_budgets:
      saved = budgets.as_saved(budgets.get_budget(table, name))
      assert json.loads(json.dumps(saved)) == saved, (table, name)
  width = budgets.as_saved(budgets.get_budget("clicktrain_table1", "cpu"))["width"]
  assert width == {"resnet": 0.125, "vgg": 0.25}
  with pytest.raises(TypeError, match="set"):
    budgets.as_saved({"rows": {"a"}})


def test_results_page_puts_paper_numbers_beside_ours():
  page = pages.results_page(
    "T",
    command="cmd --budget cpu",
    budget_name="cpu",
    budget={"width": 0.5, "epochs": 3, "batch_size": 64, "train_subset": None},
    machine="m",
    columns=["acc", "FLOPs"],
    rows=[("dense", [95.3, None], ["81.0", "100%"]), ("mag", [95.2, "50%"], ["80.5", "60%"])],
    logs={"dense": "logs/dense.jsonl"},
    notes=["a note"],
    date="today",
  )
  lines = page.splitlines()
  table = [line for line in lines if line.startswith("|")]
  assert _cells(table[0]) == [
    "row",
    "acc (paper)",
    "acc (ours)",
    "FLOPs (paper)",
    "FLOPs (ours)",
    "per-epoch log",
  ]
  assert _cells(table[2]) == [
    "dense",
    "95.3",
    "81.0",
    "—",
    "100%",
    "[dense.jsonl](logs/dense.jsonl)",
  ]
  assert _cells(table[3]) == ["mag", "95.2", "80.5", "50%", "60%", "—"]
  assert (
    "- Budget: `cpu` (width ×0.5, 50,000 training / 10,000 test images, 3 epochs at batch 64)"
    in page
  )
  assert "- Command: `cmd --budget cpu`" in page and "- a note" in page


def test_results_page_rejects_rows_that_do_not_fit_the_columns():
  with pytest.raises(ValueError, match="rows: 'x'"):
    pages.results_page(
      "T",
      command="c",
      budget_name="cpu",
      budget={"width": 1.0, "batch_size": 1},
      machine="m",
      columns=["a", "b"],
      rows=[("x", [1], [1, 2])],
    )


def test_prunetrain_table_page_gathers_rows_written_separately(tmp_path):
  paper = prunetrain_table1.PAPER
  budget = dict(budgets.get_budget("prunetrain_table1", "cpu"))
  stale = {**budget, "penalty_ratio": budget["penalty_ratio"] + 0.05}
  for row, acc, args in (
    ("resnet32", 0.70, budget),
    ("vgg11", 0.60, budget),
    ("vgg13", 0.5, stale),
  ):
    runs = {
      "dense": {"test_acc": 0.80},
      "prunetrain": {"test_acc": acc, "train_flops_ratio": 0.5, "inference_flops_ratio": 0.25},
    }
    saved = {"paper": paper[f"prunetrain-{row}"], "runs": runs, "args": {"seed": 0, **args}}
    if row != "vgg11":  # a row saved without its command takes this invocation's
      saved["command"] = f"run --rows {row}"
    (tmp_path / f"table1_cpu_{row}.json").write_text(json.dumps(saved))
  with pytest.warns(RuntimeWarning, match="table1_cpu_vgg13.json.*penalty_ratio"):
    text = prunetrain_table1.write_table_page(tmp_path, "cpu", "cmd").read_text()
  rows = {_cells(line)[0]: _cells(line) for line in text.splitlines() if line.startswith("| [")}
  # the row run under another penalty ratio is left off
  assert set(rows) == {"[resnet32](table1_cpu_resnet32.md)", "[vgg11](table1_cpu_vgg11.md)"}
  # Δ acc (paper -1.8, ours -10.00), train FLOPs (paper 47%, ours 50%)
  assert rows["[resnet32](table1_cpu_resnet32.md)"][3:7] == ["-1.8", "-10.00", "47%", "50%"]
  # the page names the command of each row it shows (not the left-off one's)
  assert "- Command: `run --rows resnet32 ; cmd`" in text


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files():
  pages = [REPO / "README.md", REPO / "notebooks" / "README.md", *sorted(REPO.glob("docs/*.md"))]
  return [*pages, *sorted((REPO / "experiments" / "results").rglob("*.md"))]


def test_link_check_reads_every_markdown_page_of_the_results_and_the_readme():
  pages = set(_markdown_files())
  assert REPO / "README.md" in pages
  assert set((REPO / "experiments" / "results").rglob("*.md")) <= pages


def test_every_relative_link_points_to_an_existing_file():
  broken = []
  for page in _markdown_files():
    for target in _LINK.findall(page.read_text()):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue  # external or in-page
      path = (page.parent / target.split("#")[0]).resolve()
      if not path.exists():
        broken.append(f"{page.relative_to(REPO)} -> {target}")
  assert not broken, broken


def test_joined_commands_lists_each_command_once_and_credits_unsaved_ones_to_the_default():
  records = [{"command": "a"}, {}, {"command": "b"}, {"command": "a"}]
  assert pages.joined_commands(records, default="now") == "a ; now ; b"
  assert pages.joined_commands([], default="now") == "now"
  assert pages.joined_commands(records[2:]) == "b ; a"
  with pytest.raises(KeyError):  # without a default every record names its command
    pages.joined_commands(records)


def test_checkpoints_go_to_the_scratch_folder_or_under_out_never_to_the_results(tmp_path):
  folder = run_options.checkpoint_dir("clicktrain", "table1_cpu_vgg11_dense")
  assert folder == pages.SCRATCH / "checkpoints" / "clicktrain" / "table1_cpu_vgg11_dense"
  assert pages.RESULTS not in folder.parents
  assert run_options.checkpoint_dir("sdgp", "x", out=tmp_path) == tmp_path / "checkpoints" / "x"
  with pytest.raises(ValueError, match="paper"):
    run_options.checkpoint_dir("resnet", "x")


def _alternatives(names):
  return "(?:" + "|".join(re.escape(n) for n in names) + ")"


# Per paper folder: its tables, the rows (models) and the methods (regular expressions).
_SCHEME = {
  "clicktrain": (
    ["table1", "table1-aligned"],
    [*clicktrain_table1.PAPER, *clicktrain_table1.EXTRA_ROWS],
    # The fine-grained and aligned runs, with the transition options' suffixes
    # (transition_options.suffix's order).
    ["dense", r"(?:clicktrain|aligned-g\d+c?)(?:-ramp[lc])?(?:-win\d+)?(?:-rw\d+)?(?:-hp\d+)?"],
  ),
  # PruneTrain's networks, and ClickTrain's (ClickTrain Table 1's PruneTrain rows)
  "prunetrain": (
    ["table1"],
    [*prunetrain_table1.ROWS, *(f"clicktrain-{row}" for row in prunetrain_table1.ROWS)],
    ["dense", "prunetrain"],
  ),
  "sdgp": (
    ["table1", "fig8", "timemodel"],
    [sdgp_table1.MODEL.removeprefix("sdgp-")],
    ["dense", *(rf"{m}_\d+-\d+" for m in sdgp_table1.ROWS if m != "dense")],
  ),
}


# Pages of commands that are not tables (prunetrain_any_model, prunetrain_transformers).
_OWN_PAGES = (
  "index.md",
  "any_model.md",
  "any_model.json",
  "transformers.md",
  "transformers.json",
  "transformers_loss.png",
)


@pytest.mark.parametrize("paper", sorted(_SCHEME))
def test_results_follow_one_naming_scheme(paper):
  """``<table>_<budget>[_<dtype>][_<row>...]`` for pages, JSON and plots (the dtype marker of a
  run that is not fp32; ``_seed<S>`` after the method of a run under another seed),
  ``logs/<table>_<budget>[_<dtype>]_<row>_<method>[_seed<S>].jsonl`` for logs,
  anything else (probes) under ``probes/``, nothing more."""
  tables, rows, methods = _SCHEME[paper]
  names = {name for table in budgets.BUDGETS.values() for name in table}
  dtypes = [name for name in cli.DTYPES if name != "fp32"]
  # a width sweep's run (ClickTrain Table 1's --width) marks its width after the budget
  width = r"(?:_w\d+(?:\.\d+)?)?"
  head = (
    f"{_alternatives(tables)}_{_alternatives(sorted(names))}(?:_{_alternatives(dtypes)})?{width}"
  )
  row, method = _alternatives(rows), "(?:" + "|".join(methods) + ")"
  plot = "(?:_(?:patterns|sparsity|over_training|time))?"
  seed = r"(?:_seed\d+)?"  # a run under a seed other than the table's 0
  page = rf"{head}(?:_{row}(?:_{method}{seed})?{plot})?\.(?:md|json|png)"
  log = rf"{head}_{row}_{method}{seed}\.jsonl"
  folder = pages.RESULTS / paper
  odd = []
  for path in folder.rglob("*"):
    rel = path.relative_to(folder)
    if rel.parts[0] == "probes":
      continue
    if path.is_dir():
      ok = str(rel) == "logs"
    elif rel.parts[0] == "logs":
      ok = len(rel.parts) == 2 and re.fullmatch(log, path.name)
    else:
      # index.md, PruneTrain's coverage and transformer pages, or a table's page
      ok = path.name in _OWN_PAGES or re.fullmatch(
        page, path.name
      )
    if not ok:
      odd.append(str(rel))
  assert not odd, odd


def test_sdgp_logs_name_the_model_as_the_row():
  assert sdgp_table1.log_name("table1_cpu", "dense", 2, 4) == "logs/table1_cpu_resnet9_dense.jsonl"
  assert sdgp_table1.log_name("fig8_cpu", "mvue", 1, 8) == "logs/fig8_cpu_resnet9_mvue_1-8.jsonl"


def test_each_table_writes_to_the_results_folder_of_the_paper_it_is_named_after():
  assert set(budgets.PAPER_OF) == set(budgets.BUDGETS)
  for table, folder in budgets.PAPER_OF.items():
    assert folder in budgets.PAPERS and table.startswith(folder + "_")
  with pytest.raises(ValueError, match="does not start with a paper"):
    budgets._results_of("nopaper_table1")

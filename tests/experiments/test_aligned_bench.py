"""aligned_bench runs end to end on a tiny setting and reports ratios of its own timings."""

import json

import pytest

from experiments.clicktrain import aligned_bench


def test_aligned_bench_tiny_run_writes_tables(tmp_path):
  # G = 2 alone: its per-group and shared-column rows, and G = 1 without the gather.
  argv = "--small --width 0.125 --batch 2 --repeats 1 --models vgg11 --groups 2"
  argv += f" --dtypes fp32 --no-imagenet --layers 2 --out {tmp_path}"
  result = aligned_bench.main(argv.split())
  assert "steps" not in result  # the whole step is step_bench's
  assert len(result["layers"]) == 2
  for row in result["layers"]:
    assert set(row["ms"]) == {"dense", "aligned G=2", "aligned G=2 shared", "G=1 no gather"}
    assert all(ms > 0 for ms in row["ms"].values())
    assert row["compression"] > 2.25  # 9/4 from the patterns alone, then kernels
  saved = json.loads((tmp_path / "aligned_bench_cpu_small.json").read_text())
  assert saved["layers"] == json.loads(json.dumps(result["layers"]))
  page = (tmp_path / "aligned_bench_cpu_small.md").read_text()
  row = result["layers"][0]
  ratio = row["ms"]["aligned G=2"] / row["ms"]["dense"]  # this run's own dense conv
  assert f"({ratio:.2f}×)" in page and "Whole train step" not in page


def test_small_fills_only_the_sizes_the_command_line_leaves_out():
  # Before: --small overrode --width/--batch/--repeats given beside it, without a word.
  args = aligned_bench._parse(["--small", "--width", "0.125", "--batch", "2"])
  assert (args.width, args.batch, args.imagenet_batch, args.repeats) == (0.125, 2, 4, 3)
  args = aligned_bench._parse(["--repeats", "5"])
  assert (args.width, args.batch, args.imagenet_batch, args.repeats) == (1.0, 128, 64, 5)


def test_models_take_short_or_full_names_and_refuse_others(capsys):
  assert aligned_bench._parse(["--models", "clicktrain-vgg11", "resnet32"]).models == [
    "vgg11",
    "resnet32",
  ]
  with pytest.raises(SystemExit):
    aligned_bench._parse(["--models", "resnet50"])
  assert "invalid choice: 'resnet50'" in capsys.readouterr().err

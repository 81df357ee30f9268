"""aligned_bench runs end to end on a tiny setting and reports ratios of its own timings."""

import json

from experiments import aligned_bench


def test_aligned_bench_tiny_run_writes_tables(tmp_path):
  argv = "--small --width 0.125 --batch 2 --repeats 1 --models vgg11 --groups 1 2 --measured"
  argv += f" --dtypes fp32 --no-imagenet --layers 2 --out {tmp_path}"
  result = aligned_bench.main(argv.split())
  steps = result["steps"]
  assert [s["variant"] for s in steps] == ["dense", "aligned G=1", "aligned G=2"]
  assert all(s["dense_ms"] == steps[0]["ms"] > 0 for s in steps)  # ratios use this run's dense
  assert all(s["compression"] > 2.25 for s in steps)  # 9/4 from the patterns alone, then kernels
  assert len(result["layers"]) == 2
  for row in result["layers"]:
    assert {"dense", "aligned G=1", "aligned G=2", "G=1 no gather"} <= set(row["ms"])
  saved = json.loads((tmp_path / "aligned_bench_cpu_small.json").read_text())
  assert saved["steps"] == steps
  page = (tmp_path / "aligned_bench_cpu_small.md").read_text()
  ratio = steps[1]["ms"] / steps[0]["ms"]
  assert f"{ratio:.2f}×" in page

"""Tests for jaxprune.flops.report: the markdown table and report."""

from __future__ import annotations

import pytest

from jaxprune import flops


def test_format_table_rows_and_totals(tiny_resnet):
  model = tiny_resnet
  layers = flops.layer_flops(model, (1, 8, 8, 3))
  table = flops.format_table(layers, scale=1.0, unit="FLOPs")
  lines = table.splitlines()
  assert len(lines) == 2 + len(layers) + 1
  assert lines[2].startswith("| stem/conv/kernel | conv | 3×3×3×4 |")
  total_cells = [c.strip() for c in lines[-1].split("|")[1:-1]]
  assert float(total_cells[8]) == pytest.approx(sum(l.forward for l in layers), rel=1e-3)
  assert float(total_cells[11]) == pytest.approx(flops.training_flops_per_step(layers), rel=1e-3)


def test_model_flops_report_mentions_totals(tiny_resnet):
  model = tiny_resnet
  report = flops.model_flops_report(model, (1, 8, 8, 3))
  inference = flops.inference_flops(model, (1, 8, 8, 3))
  assert f"inference FLOPs: {inference:,}" in report
  assert "stages/0/0/shortcut/conv/kernel" in report

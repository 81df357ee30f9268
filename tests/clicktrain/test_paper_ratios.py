"""``clicktrain.preset.paper_kernel_ratios``: the paper's per-layer kernel-prune ratios, one copy
for the released configs and the Table 1 rows (tests/experiments/test_clicktrain_table1.py
checks the rows' layers against the lists the table used before)."""

import pytest

from jaxprune import clicktrain
from jaxprune.clicktrain import preset


def test_the_released_configs_read_the_same_lists():
  for arch, config in clicktrain.RELEASED_CIFAR10.items():
    ratios = preset.paper_kernel_ratios(f"clicktrain-{arch}")
    count = len(config["kernel_prune_ratio"])
    listed = [ratios(f"features/{i}/conv/kernel", (3, 3, 8, 8)) for i in range(1, count + 1)]
    assert tuple(listed) == config["kernel_prune_ratio"]


def test_resnets_share_the_stage_ratios():
  for name in ("clicktrain-resnet18", "clicktrain-resnet32", "clicktrain-resnet50"):
    ratios = preset.paper_kernel_ratios(name)
    by_stage = [ratios(f"stages/{s}/0/conv1/kernel", (3, 3, 8, 8)) for s in range(4)]
    assert by_stage == [0.55, 0.65, 0.75, 0.75]


def test_unknown_models_and_unpruned_layers_are_value_errors():
  with pytest.raises(ValueError, match="no per-layer ratios for 'prunetrain-vgg11'"):
    preset.paper_kernel_ratios("prunetrain-vgg11")
  vgg11 = preset.paper_kernel_ratios("clicktrain-vgg11")
  for path in ("features/0/conv/kernel", "features/8/conv/kernel", "stages/0/0/conv1/kernel"):
    with pytest.raises(ValueError, match="not a conv of 'clicktrain-vgg11' that ClickTrain prunes"):
      vgg11(path, (3, 3, 8, 8))
  with pytest.raises(ValueError, match="prunes"):
    preset.paper_kernel_ratios("clicktrain-resnet32")("stem/conv/kernel", (3, 3, 3, 8))

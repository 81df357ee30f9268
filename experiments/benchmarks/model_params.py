"""Parameter counts of every registered model, as a markdown table.

Counts ``nnx.Param`` entries (conv and linear weights, biases, BatchNorm γ and β; not the
running statistics), on abstract models (``nnx.eval_shape``: nothing is allocated), with 10
classes for the CIFAR families and 1000 for ImageNet. The reference column holds the figures
this library must reproduce (the papers, torchvision, kuangliu/pytorch-cifar).

    python -m experiments.run model_params [--publish | --output PATH]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import flax
import jax
from flax import nnx

from experiments.common import cli, pages
from jaxprune import models

# Published / design figures (parameters), with their source.
_REFERENCE = {
  "prunetrain-resnet32": ("≈0.467 M", "PruneTrain paper"),
  "prunetrain-resnet50": ("≈0.777 M", "PruneTrain paper"),
  "clicktrain-resnet18": ("11,173,962", "kuangliu/pytorch-cifar"),
  "clicktrain-resnet32": ("≈20.1 M", "ClickTrain released code"),
  "sdgp-resnet9": ("≈9.09 M", "SDGP (ffcv ResNet-9)"),
  "imagenet-resnet18": ("11,689,512", "torchvision"),
  "imagenet-resnet50": ("25,557,032", "torchvision"),
}


def num_classes_for(name: str) -> int:
  """1000 for the ImageNet family, 10 (CIFAR-10) otherwise."""
  return 1000 if name.startswith("imagenet-") else 10


def count(name: str, **create_kwargs) -> int:
  """Parameter count of registered model ``name`` (built abstractly)."""
  abstract = nnx.eval_shape(
    lambda: models.create(
      name, num_classes=num_classes_for(name), rngs=nnx.Rngs(0), **create_kwargs
    )
  )
  return models.param_count(abstract)


def _describe(spec) -> str:
  if isinstance(spec, models.ResNetSpec):
    widths = "/".join(str(stage.width) for stage in spec.stages)
    blocks = ",".join(str(n) for n in spec.num_blocks)
    return f"{spec.block} [{blocks}], stem {spec.stem_width}, stage widths {widths}"
  if isinstance(spec, models.VGGSpec):
    return (
      f"{len(spec.widths)} convs, {len(spec.pool_after)} pools, "
      f"hidden {list(spec.hidden) or 'none'}"
    )
  if isinstance(spec, models.ResNet9Spec):
    return (
      f"convs {spec.prep},{spec.layer1},{list(spec.res1)},{spec.layer2},"
      f"{list(spec.res2)},{spec.layer3}"
    )
  return type(spec).__name__


def table(names: Sequence[str]) -> str:
  """Markdown table: name, model class, spec summary, classes, parameters, reference."""
  lines = [
    "| name | class | structure | classes | parameters | reference |",
    "|---|---|---|---:|---:|---|",
  ]
  for name in names:
    spec = models.default_spec(name)
    model_class = {
      models.ResNetSpec: "ResNet",
      models.VGGSpec: "VGG",
      models.ResNet9Spec: "ResNet9",
    }[type(spec)]
    params = count(name)
    ref, source = _REFERENCE.get(name, ("", ""))
    reference = f"{ref}, {source}" if ref else ""
    lines.append(
      f"| `{name}` | `{model_class}` | {_describe(spec)} | {num_classes_for(name)} "
      f"| {params:,} ({params / 1e6:.3f} M) | {reference} |"
    )
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
  """Writes the table to ``--output`` and returns it."""
  parser = argparse.ArgumentParser(prog="model_params", description=__doc__.splitlines()[0])
  parser.add_argument("--output", type=Path, default=None, help="default: model_params.md")
  cli.add_publish_argument(parser, "benchmarks/")
  args = parser.parse_args(argv)
  if args.output is None:
    args.output = pages.output_dir("benchmarks", args.publish) / "model_params.md"
  command = cli.command_line("model_params", argv)
  body = table(models.available())
  text = (
    "# Registered models and parameter counts\n\n"
    f"Command: `{command.strip()}`  \n"
    f"Date: {pages.utc_now()}  \n"
    f"JAX {jax.__version__}, Flax {flax.__version__}\n\n"
    "Parameters = `nnx.Param` entries (weights, biases, BatchNorm γ/β; running statistics "
    "excluded). `prunetrain-*` and `clicktrain-*` models of the same name are different "
    "networks (see docs/design.md).\n\n"
    f"{body}\n"
  )
  args.output.parent.mkdir(parents=True, exist_ok=True)
  args.output.write_text(text)
  print(f"wrote {args.output}")
  return text


if __name__ == "__main__":
  main(sys.argv[1:])

"""The README's "Using each method" snippets run as written, on stand-ins for CIFAR-10 (a few
random 16x16 images) and for the model (at 1/16 width); ``Trainer.fit`` is recorded, not run."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
from flax import nnx

from jaxprune import data, models, train

_README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _usage_blocks() -> list[str]:
  text = _README.read_text()
  section = text.split("## Using each method", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def _arrays(model: nnx.Module) -> set[int]:
  return {id(x) for x in jax.tree.leaves(nnx.state(model))}


def _stand_ins(monkeypatch) -> None:
  """CIFAR-10 as 128 random 16x16 images, every model at 1/16 width."""
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (128, 16, 16, 3), dtype=np.uint8)
  small = data.Dataset.from_arrays(images, rng.integers(0, 10, 128), num_classes=10)
  monkeypatch.setattr(data, "load", lambda name, **kwargs: small)
  create = models.create
  monkeypatch.setattr(
    models, "create", lambda name, **kwargs: create(name, width_multiplier=1 / 16, **kwargs)
  )


def test_readme_usage_snippets_run_with_one_model_per_run(monkeypatch):
  _stand_ins(monkeypatch)
  fits = []
  monkeypatch.setattr(train.Trainer, "fit", lambda self, *args, **kwargs: fits.append(self))

  blocks = _usage_blocks()
  assert len(blocks) == 3
  namespace: dict = {}
  exec(blocks[0], namespace)  # noqa: S102 (the README's own code)
  runs = [namespace[n] for n in ("clicktrain_run", "prunetrain_run", "sdgp_run")]
  assert fits == [runs[0]]
  # Three alternatives, three models: no model, and no array, is held by two trainers.
  held = [_arrays(run.model) for run in runs]
  assert len({id(run.model) for run in runs}) == 3
  assert not (held[0] & held[1] or held[0] & held[2] or held[1] & held[2])

  # The jitted nnx.Optimizer step: one batch (128 examples), one optimizer step.
  exec(blocks[1], namespace)  # noqa: S102
  model = namespace["model"]
  assert np.isfinite(float(namespace["loss"]))
  assert int(namespace["optimizer"].step[...]) == 1

  exec(blocks[2], namespace)  # noqa: S102
  assert isinstance(namespace["trainer"], train.Trainer)
  assert namespace["model"] is not model


def test_readme_own_loop_runs_with_the_guard_and_a_reconfiguration(monkeypatch):
  """The "Your own loop" snippet, after the usage snippets it names: 20 one-step epochs, two
  reconfigurations through the guarded optimizer, BatchNorm statistics re-estimated."""
  _stand_ins(monkeypatch)
  monkeypatch.setattr(train.Trainer, "fit", lambda self, *args, **kwargs: None)
  text = _README.read_text()
  section = text.split("## Your own loop", 1)[1].split("\n## ", 1)[0]
  (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
  namespace: dict = {}
  for usage in _usage_blocks()[:2]:
    exec(usage, namespace)  # noqa: S102 (the README's own code)
  exec(block, namespace)  # noqa: S102
  optimizer = namespace["optimizer"]
  assert isinstance(optimizer.opt_state, train.SkipNonFiniteState)
  assert int(optimizer.opt_state.skipped) == 0
  from jaxprune import prunetrain

  assert isinstance(namespace["report"], prunetrain.ReconfigureReport)
  params = nnx.state(namespace["model"], nnx.Param)
  assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(params))

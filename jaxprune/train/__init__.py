"""Training loop for jaxprune: jitted steps accepting any Optax transform, PyTorch-style
SGD and schedules, evaluation with flip TTA, orbax checkpoints with exact resume, and
host-side hooks (PruneTrain reconfiguration, dynamic mini-batch, extra metrics).

Example::

    from flax import nnx
    from jaxprune import data, models, train

    train_set, test_set = data.load("cifar10"), data.load("cifar10", split="test")
    loader = data.Loader(train_set, 128, augment="prunetrain", seed=0)
    test_loader = data.Loader(test_set, 500, shuffle=False, drop_last=False)
    model = models.create("prunetrain-resnet32", num_classes=10, rngs=nnx.Rngs(0))
    tx = train.sgd(train.step_schedule(0.1, len(loader), [91, 136]), momentum=0.9,
                   weight_decay=5e-4)
    trainer = train.Trainer(model, tx, log_path="runs/r32/log.jsonl",
                            checkpoint_dir="runs/r32/ckpt")
    history = trainer.fit(loader, test_loader, epochs=182)   # resumes if interrupted

Data parallelism over every device: ``train.Trainer(model, tx, mesh="auto")`` (the loader's
batch is the global one, split over a mesh axis ``"batch"``; see
:mod:`jaxprune.train.data_parallel`).

A training loader is any iterable of ``(images, labels)`` batches; what else the trainer uses
of one when it has it (a length, a batch size, ``set_epoch``, a position for exact resume) is
named by :class:`HostLoader`, and a data set on the device whose batches the trainer makes
inside its step (:class:`jaxprune.data.DeviceLoader`) by :class:`FusedLoader`.
:class:`LoaderView` reads a loader once for the trainer and for hooks.

Any Optax transform works in place of ``train.sgd`` (``GradientTransformationExtraArgs``
receive ``value=loss``); LR scaling needs a ``train.scale_by_lr`` inside it.
"""

from jaxprune.train._checks import NonFiniteError
from jaxprune.train._loaders import FusedLoader, HostLoader, LoaderView
from jaxprune.train._spec_json import decode_spec, encode_spec
from jaxprune.train.batchnorm import epoch_batches, recompute_batch_stats
from jaxprune.train.callbacks import Callback, TrainerLike
from jaxprune.train.checkpoint import CheckpointStore, DamagedCheckpointError, FolderInUseError
from jaxprune.train.guard import SkipNonFiniteState, skip_nonfinite
from jaxprune.train.loss import (
  accuracy,
  correct_per_example,
  cross_entropy,
  cross_entropy_per_example,
)
from jaxprune.train.optim import (
  EpochLengthState,
  ScaleByLrState,
  epoch_length_state,
  find_epoch_lengths,
  get_lr,
  get_lr_scale,
  kernels_only,
  scale_by_lr,
  set_lr_scale,
  set_step_increment,
  sgd,
)
from jaxprune.train.schedules import step_schedule, triangular_schedule, with_rewind, with_warmup
from jaxprune.train._nonfinite import NonFiniteState
from jaxprune.train.compiled import (
  memory_bytes,
  step_functions,
  step_settings,
  train_step_memory,
)
from jaxprune.train.step import (
  Metrics,
  StepFunctions,
  StepSettings,
  TrainState,
  default_loss,
  split_model,
  train_step,
)
from jaxprune.train.trainer import Trainer, fit

__all__ = [
  "epoch_batches",
  "recompute_batch_stats",
  "CheckpointStore",
  "DamagedCheckpointError",
  "FolderInUseError",
  "NonFiniteError",
  "SkipNonFiniteState",
  "skip_nonfinite",
  "decode_spec",
  "encode_spec",
  "accuracy",
  "correct_per_example",
  "cross_entropy",
  "cross_entropy_per_example",
  "EpochLengthState",
  "ScaleByLrState",
  "epoch_length_state",
  "find_epoch_lengths",
  "get_lr",
  "get_lr_scale",
  "kernels_only",
  "scale_by_lr",
  "set_lr_scale",
  "set_step_increment",
  "sgd",
  "step_schedule",
  "triangular_schedule",
  "with_rewind",
  "with_warmup",
  "Metrics",
  "NonFiniteState",
  "StepFunctions",
  "StepSettings",
  "TrainState",
  "default_loss",
  "memory_bytes",
  "split_model",
  "step_functions",
  "step_settings",
  "train_step",
  "train_step_memory",
  "Callback",
  "TrainerLike",
  "FusedLoader",
  "HostLoader",
  "LoaderView",
  "Trainer",
  "fit",
]

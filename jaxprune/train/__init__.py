"""Training loop for jaxprune: jitted steps accepting any Optax transform, PyTorch-style
SGD and schedules, evaluation with flip TTA, orbax checkpoints with exact resume, and
host-side hooks (PruneTrain reconfiguration, dynamic mini-batch, extra metrics)."""

from jaxprune.train.checkpoint import CheckpointStore
from jaxprune.train.loss import (accuracy, correct_per_example, cross_entropy,
                                 cross_entropy_per_example)
from jaxprune.train.optim import (ScaleByLrState, get_lr, get_lr_scale, kernels_only,
                                  scale_by_lr, set_lr_scale, set_step_increment, sgd)
from jaxprune.train.schedules import step_schedule, triangular_schedule, with_warmup
from jaxprune.train.step import (Metrics, StepFunctions, default_loss, memory_bytes,
                                 split_model, step_functions,
                                 train_step_memory)
from jaxprune.train.trainer import Callback, Trainer, fit
from jaxprune.train.callbacks import Reconfigure

__all__ = [
    "CheckpointStore", "accuracy", "correct_per_example", "cross_entropy",
    "cross_entropy_per_example", "ScaleByLrState", "get_lr", "get_lr_scale", "kernels_only",
    "scale_by_lr", "set_lr_scale", "set_step_increment", "sgd", "step_schedule",
    "triangular_schedule", "with_warmup", "Metrics", "StepFunctions", "default_loss",
    "memory_bytes", "split_model", "step_functions", "train_step_memory", "Callback", "Trainer", "fit", "Reconfigure",
]

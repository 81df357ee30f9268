"""jaxprune: pruning during training in JAX/Flax NNX.

Implements ClickTrain (pattern pruning), PruneTrain (channel group lasso with
reconfiguration) and SDGP (N:M pruning of data gradients) as Optax gradient
transformations over Flax NNX models. One package per paper
(:mod:`jaxprune.clicktrain`, :mod:`jaxprune.prunetrain`, :mod:`jaxprune.sdgp`), shared
models, data, training loop, weight masks (:mod:`jaxprune.masking`) and cost accounting
beside them. The papers are those of :data:`jaxprune.methods.PAPERS`: importing
:mod:`jaxprune.methods`, which sits above them, brings each paper's package in.
"""

__version__ = "0.1.0"

from jaxprune import data, distributed, flops, masking, methods, models, multihost, paths, train

__all__ = [
  "data",
  "distributed",
  "flops",
  "masking",
  "methods",
  "models",
  "multihost",
  "paths",
  "train",
]
# The paper packages: those methods.PAPERS lists (importing methods brings them in).
__all__ += [paper.name for paper in methods.PAPERS]

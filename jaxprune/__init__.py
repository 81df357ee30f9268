"""jaxprune: pruning during training in JAX/Flax NNX.

Implements ClickTrain (pattern pruning), PruneTrain (channel group lasso with
reconfiguration) and SDGP (N:M pruning of data gradients) as Optax gradient
transformations over Flax NNX models. One package per paper
(:mod:`jaxprune.clicktrain`, :mod:`jaxprune.prunetrain`, :mod:`jaxprune.sdgp`), shared
models, data, training loop, weight masks (:mod:`jaxprune.masking`) and cost accounting
beside them.
"""

__version__ = "0.1.0"

from jaxprune import paths
from jaxprune import masking
from jaxprune import data
from jaxprune import distributed
from jaxprune import multihost
from jaxprune import flops
from jaxprune import models
from jaxprune import train
from jaxprune import clicktrain
from jaxprune import prunetrain
from jaxprune import sdgp
from jaxprune import methods

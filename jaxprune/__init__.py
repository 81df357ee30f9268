"""jaxprune: pruning during training in JAX/Flax NNX.

Implements ClickTrain (pattern pruning), PruneTrain (channel group lasso with
reconfiguration) and SDGP (N:M pruning of data gradients) as Optax gradient
transformations over Flax NNX models.
"""

__version__ = "0.1.0"

from jaxprune import data
from jaxprune import distributed
from jaxprune import flops
from jaxprune import group_lasso, prunetrain
from jaxprune import models
from jaxprune import train
from jaxprune import importance
from jaxprune import patterns
from jaxprune import sdgp
from jaxprune import clicktrain_transform
from jaxprune.clicktrain_transform import clicktrain

"""FLOPs, compression, memory-traffic and communication accounting for pruned models.

The three papers report costs differently, and this package gives the pieces for each:

* **PruneTrain** (Lym et al., SC'19, §3 Fig. 2, §5 Tab. 1) reports *training* FLOPs integrated over
  the whole run while the network shrinks at every reconfiguration, inference FLOPs of the final
  model, the memory traffic of the (bandwidth-bound) BatchNorm layers and the ring all-reduce
  volume of the weight gradients (§5, Fig. 11).
  → :func:`training_flops_per_step`, :func:`integrate_training_flops`, :func:`inference_flops`,
  :func:`batchnorm_traffic`, :func:`allreduce_bytes`
  (:func:`layer_flops_and_batchnorm_traffic` gives the FLOPs and the traffic from one trace).
* **ClickTrain** (Zhang et al., ICS'21, Tab. 1) reports the compression ratio over conv layers and
  the training / inference FLOPs saved once the pattern + connectivity masks are hard-pruned.
  → :func:`compression_ratio`, :func:`conv_sparsity`, and every FLOPs function with ``masks=``.
* **SDGP** (arXiv 2022, §IV-C) uses a *time* model: data-gradient convolutions take about a third
  of the conv time and an n:m sparsity divides that share by m/n. The per-layer split into
  forward, backward-data and backward-weight FLOPs in :class:`LayerFlops` is what that model needs
  (see ``backward_data_density`` of :func:`training_flops_per_step`).

Counting conventions (used everywhere in this package):

* One multiply-add is **2 FLOPs**. A conv's forward pass costs
  ``2 · batch · out_h · out_w · kh · kw · (Cin / groups) · Cout``; a dense layer's
  ``2 · rows · Din · Dout``. Padding positions are counted like any other (the usual convention).
* Backward-data (the input gradient, a transposed conv / matmul) and backward-weight (the weight
  gradient) each cost as much as the forward pass.
* A layer whose input does not depend on any trainable parameter (the stem conv that reads the
  image) has **no backward-data cost**: nobody needs the gradient with respect to the input
  images. This is decided from the traced data flow, not from the layer's position.
* With weight masks only the nonzero weights are counted: a masked conv costs
  ``2 · batch · out_h · out_w · nnz(kernel)`` for the forward pass and the same for each backward
  part. ClickTrain §5.2 runs the forward and the data-gradient convs (δ ⊛ rot180(W)) with the
  sparse W; the weight gradient is needed only at the kept positions, so it is counted sparse
  too.

Layers are found by **tracing**: :func:`layer_flops` runs :func:`jax.make_jaxpr` on the forward
pass, walks every ``conv_general_dilated`` and ``dot_general`` equation (also inside ``jit``,
``custom_vjp_call``, ``custom_jvp_call``, ``remat``, ``scan``, ``cond``, ``while`` and
``pallas_call`` bodies) and
follows the weight operand back through shape- and value-preserving operations (mask multiply,
dtype conversion, reshape, transpose, ...) to the parameter leaf that feeds it. So it works for any
Flax NNX model and for any plain ``fn(params, x)``, including SDGP's custom-VJP conv.

Only shapes matter, so the model can be abstract (no weights allocated or initialized)::

    model = nnx.eval_shape(lambda: jaxprune.models.create(
        "prunetrain-resnet32", num_classes=10, rngs=nnx.Rngs(0)))
    layers = flops.layer_flops(model, (1, 32, 32, 3))
    print(flops.format_table(layers))
    per_image = flops.training_flops_per_step(layers)

One module per job, all re-exported here:

* :mod:`~jaxprune.flops.layers`: per-layer FLOPs and the training / inference totals;
* :mod:`~jaxprune.flops.report`: markdown tables and reports;
* :mod:`~jaxprune.flops.sparsity`: compression ratio and conv sparsity;
* :mod:`~jaxprune.flops.memory`: BatchNorm memory traffic;
* :mod:`~jaxprune.flops.communication`: gradient all-reduce volume;
* :mod:`~jaxprune.flops.shortcuts`: which 1x1 convs are projection shortcuts (the structure
  ClickTrain's layer choice reads);
* ``_trace`` (private): the tracing and the jaxpr walker that ``layers`` and ``memory`` share.
"""

from jaxprune.flops.communication import (
  AllReduce,
  CompiledAllReduces,
  allreduce_bytes,
  compiled_allreduces,
)
from jaxprune.flops.layers import (
  LayerFlops,
  inference_flops,
  integrate_training_flops,
  layer_flops,
  training_flops_per_step,
)
from jaxprune.flops.memory import (
  BatchNormTraffic,
  batchnorm_traffic,
  layer_flops_and_batchnorm_traffic,
)
from jaxprune.flops.report import format_table, model_flops_report
from jaxprune.flops.shortcuts import projection_shortcuts
from jaxprune.flops.sparsity import compression_ratio, conv_sparsity

# Older callers import the parameter-path helper from here; its home is jaxprune.paths.
from jaxprune.paths import param_path

__all__ = [
  "projection_shortcuts",
  "LayerFlops",
  "BatchNormTraffic",
  "layer_flops",
  "training_flops_per_step",
  "inference_flops",
  "integrate_training_flops",
  "format_table",
  "model_flops_report",
  "compression_ratio",
  "conv_sparsity",
  "batchnorm_traffic",
  "layer_flops_and_batchnorm_traffic",
  "allreduce_bytes",
  "compiled_allreduces",
  "AllReduce",
  "CompiledAllReduces",
  "param_path",
]

"""Small pre-norm transformers written plainly: a ViT for images and a decoder-only LM.

The layers are the ones people train now, at widths a CPU can run: multi-head attention with
grouped-query heads (``num_kv_heads`` < ``num_heads``: each key/value head serves a group of
query heads), a plain GELU MLP or a gated SwiGLU one (Shazeer, 2020), LayerNorm or RMSNorm,
and no biases in the projections, so a head or an MLP unit whose weights are zero contributes
exactly nothing. Attention is written with reshapes and einsums over ``(batch, tokens, kv
heads, group, head_dim)``, the form that PruneTrain's traced channel graph follows
(:func:`jaxprune.prunetrain.channel_graph`): it finds the heads, the grouped kv heads, the MLP
units, and the residual stream that the norms block.

Example:
  >>> from flax import nnx
  >>> from jaxprune.models.transformer import ViT
  >>> vit = ViT(dim=32, depth=2, num_heads=4, head_dim=8, mlp_hidden=64, rngs=nnx.Rngs(0))
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["MLP", "Block", "DecoderLM", "SelfAttention", "ViT"]


def _linear(cin: int, cout: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(cin, cout, use_bias=False, rngs=rngs)


class SelfAttention(nnx.Module):
  """Multi-head self-attention with ``num_kv_heads`` key/value heads (GQA when fewer).

  Args:
    dim: the residual stream's width.
    num_heads: query heads.
    head_dim: width of each head (the softmax scale is ``head_dim ** -0.5``).
    num_kv_heads: key/value heads, dividing ``num_heads`` (default ``num_heads``).
    causal: mask each token's attention to the tokens before it (a language model).
    rngs: the initialisers' keys.
  """

  def __init__(
    self,
    dim: int,
    num_heads: int,
    head_dim: int,
    *,
    num_kv_heads: Optional[int] = None,
    causal: bool = False,
    rngs: nnx.Rngs,
  ):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    for name, value in (("dim", dim), ("num_heads", num_heads), ("head_dim", head_dim)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
      raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    if num_heads % num_kv_heads:
      raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    self.head_dim = head_dim
    self.causal = causal
    self.q = _linear(dim, num_heads * head_dim, rngs)
    self.k = _linear(dim, num_kv_heads * head_dim, rngs)
    self.v = _linear(dim, num_kv_heads * head_dim, rngs)
    self.o = _linear(num_heads * head_dim, dim, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    hd = self.head_dim
    # The widths are read off the kernels, not stored: a reconfiguration that removes heads
    # narrows the kernels and the reshapes follow.
    k = self.k(x).reshape(b, t, -1, hd)  # (b, t, kv, hd)
    v = self.v(x).reshape(b, t, -1, hd)
    q = self.q(x).reshape(b, t, k.shape[2], -1, hd)  # (b, t, kv, group, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(hd)
    if self.causal:
      mask = jnp.tril(jnp.ones((t, t), bool))
      scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, v)
    return self.o(out.reshape(b, t, -1))


class MLP(nnx.Module):
  """The feed-forward block: GELU(x·up)·down, or with ``gated`` SwiGLU (silu(x·gate)·(x·up))·down.

  Args:
    dim: the residual stream's width.
    hidden: the hidden units.
    gated: SwiGLU (three projections) instead of a GELU MLP (two).
    rngs: the initialisers' keys.
  """

  def __init__(self, dim: int, hidden: int, *, gated: bool = False, rngs: nnx.Rngs):
    self.gate = _linear(dim, hidden, rngs) if gated else None
    self.up = _linear(dim, hidden, rngs)
    self.down = _linear(hidden, dim, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.gate is None:
      return self.down(nnx.gelu(self.up(x)))
    return self.down(nnx.silu(self.gate(x)) * self.up(x))


def _norm(dim: int, kind: str, rngs: nnx.Rngs) -> nnx.Module:
  if kind == "layer":
    return nnx.LayerNorm(dim, rngs=rngs)
  if kind == "rms":
    return nnx.RMSNorm(dim, rngs=rngs)
  raise ValueError(f"norm must be 'layer' or 'rms', got {kind!r}")


class _Residual(nnx.Module):
  """``x + branch(norm(x))``, a branch PruneTrain may remove whole (§4.1 layer removal).

  When every channel of the branch's own groups is dead (all of an attention's heads, all of
  an MLP's units) its output is exactly zero, and the residual computes ``x``:
  ``branch_names`` / :meth:`remove_branch` declare that to
  :func:`jaxprune.prunetrain.reconfigure`.
  """

  branch_names = ("norm", "branch")

  def __init__(self, norm: nnx.Module, branch: nnx.Module):
    self.norm = norm
    self.branch = branch

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.branch is None:
      return x
    return x + self.branch(self.norm(x))

  def remove_branch(self) -> None:
    """Drops the norm and the branch; the residual then passes ``x`` on."""
    self.norm = None
    self.branch = None


class Block(nnx.Module):
  """A pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

  Each half is a removable residual branch (``self.attention``, ``self.feed_forward``), so a
  block whose heads and MLP units have all died loses both and passes its input on.

  Args:
    dim, num_heads, head_dim, num_kv_heads, causal: see :class:`SelfAttention`.
    mlp_hidden, gated: see :class:`MLP`.
    norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm).
    rngs: the initialisers' keys.
  """

  def __init__(
    self,
    dim: int,
    num_heads: int,
    head_dim: int,
    mlp_hidden: int,
    *,
    num_kv_heads: Optional[int] = None,
    gated: bool = False,
    causal: bool = False,
    norm: str = "layer",
    rngs: nnx.Rngs,
  ):
    attn = SelfAttention(
      dim, num_heads, head_dim, num_kv_heads=num_kv_heads, causal=causal, rngs=rngs
    )
    self.attention = _Residual(_norm(dim, norm, rngs), attn)
    self.feed_forward = _Residual(
      _norm(dim, norm, rngs), MLP(dim, mlp_hidden, gated=gated, rngs=rngs)
    )

  @property
  def attn(self) -> Optional[SelfAttention]:
    """The attention (None once removed)."""
    return self.attention.branch

  @property
  def mlp(self) -> Optional[MLP]:
    """The MLP (None once removed)."""
    return self.feed_forward.branch

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.feed_forward(self.attention(x))


class ViT(nnx.Module):
  """A small Vision Transformer (Dosovitskiy et al., 2021) for 32x32 images.

  Non-overlapping ``patch`` x ``patch`` patches embedded by a strided conv, a learned
  positional embedding, ``depth`` pre-norm blocks, a final norm, the mean over tokens and a
  linear classifier.

  Args:
    dim: the residual stream's width.
    depth: blocks.
    num_heads, head_dim, num_kv_heads: see :class:`SelfAttention`.
    mlp_hidden, gated: see :class:`MLP`.
    patch: the patch size (the image side must be a multiple).
    image_size: the image side.
    in_channels: image channels.
    num_classes: logits.
    norm: see :class:`Block`.
    rngs: the initialisers' keys.
  """

  def __init__(
    self,
    *,
    dim: int = 64,
    depth: int = 4,
    num_heads: int = 4,
    head_dim: int = 16,
    mlp_hidden: int = 128,
    num_kv_heads: Optional[int] = None,
    gated: bool = False,
    patch: int = 4,
    image_size: int = 32,
    in_channels: int = 3,
    num_classes: int = 10,
    norm: str = "layer",
    rngs: nnx.Rngs,
  ):
    if image_size % patch:
      raise ValueError(f"patch ({patch}) must divide image_size ({image_size})")
    tokens = (image_size // patch) ** 2
    block_kw = dict(num_kv_heads=num_kv_heads, gated=gated, norm=norm, rngs=rngs)
    self.patch_embed = nnx.Conv(
      in_channels, dim, (patch, patch), strides=(patch, patch), padding="VALID", rngs=rngs
    )
    self.pos_embedding = nnx.Param(jax.random.normal(rngs.params(), (tokens, dim)) * 0.02)
    self.blocks = nnx.List(
      [Block(dim, num_heads, head_dim, mlp_hidden, **block_kw) for _ in range(depth)]
    )
    self.norm = _norm(dim, norm, rngs)
    self.head = nnx.Linear(dim, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.patch_embed(x)
    x = x.reshape(x.shape[0], -1, x.shape[-1]) + self.pos_embedding[...]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x).mean(axis=1))


class DecoderLM(nnx.Module):
  """A small decoder-only language model over bytes (vocabulary 256 by default).

  Token and learned positional embeddings, ``depth`` causal pre-norm blocks (RMSNorm and
  SwiGLU by default, as in current LMs), a final norm and an untied output projection.

  Args:
    vocab: vocabulary size.
    context: the longest sequence (positional embeddings).
    dim, depth, num_heads, head_dim, num_kv_heads, mlp_hidden, gated, norm: see :class:`ViT`.
    rngs: the initialisers' keys.
  """

  def __init__(
    self,
    *,
    vocab: int = 256,
    context: int = 128,
    dim: int = 64,
    depth: int = 4,
    num_heads: int = 4,
    head_dim: int = 16,
    mlp_hidden: int = 128,
    num_kv_heads: Optional[int] = None,
    gated: bool = True,
    norm: str = "rms",
    rngs: nnx.Rngs,
  ):
    block_kw = dict(num_kv_heads=num_kv_heads, gated=gated, causal=True, norm=norm, rngs=rngs)
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.pos_embedding = nnx.Param(jax.random.normal(rngs.params(), (context, dim)) * 0.02)
    self.blocks = nnx.List(
      [Block(dim, num_heads, head_dim, mlp_hidden, **block_kw) for _ in range(depth)]
    )
    self.norm = _norm(dim, norm, rngs)
    self.head = _linear(dim, vocab, rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[1]
    x = self.embed(tokens) + self.pos_embedding[:t]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))

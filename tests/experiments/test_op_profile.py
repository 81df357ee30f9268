"""The op-kind split of a compiled step (experiments/op_profile.py)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from experiments.common import op_profile

# A hand-written module: a fusion that calls a fusion holding a convolution, a transpose
# fusion, a plain elementwise op and a fusion of elementwise ops.
_HLO = """HloModule toy

%inner (p: f32[2,4,4,3], k: f32[3,3,3,5]) -> f32[2,4,4,5] {
  %p = f32[2,4,4,3]{3,2,1,0} parameter(0)
  %k = f32[3,3,3,5]{3,2,1,0} parameter(1)
  ROOT %conv.1 = f32[2,4,4,5]{3,2,1,0} convolution(%p, %k), window={size=3x3}, dim_labels=b01f_01io->b01f
}

%outer (a: f32[2,4,4,3], b: f32[3,3,3,5]) -> f32[2,4,4,5] {
  %a = f32[2,4,4,3]{3,2,1,0} parameter(0)
  %b = f32[3,3,3,5]{3,2,1,0} parameter(1)
  ROOT %call.1 = f32[2,4,4,5]{3,2,1,0} fusion(%a, %b), kind=kCustom, calls=%inner
}

%transposer (t: f32[2,4,4,3]) -> f32[3,4,4,2] {
  %t = f32[2,4,4,3]{3,2,1,0} parameter(0)
  %tr = f32[3,4,4,2]{0,2,1,3} transpose(%t), dimensions={3,1,2,0}
  ROOT %cp = f32[3,4,4,2]{3,2,1,0} copy(%tr)
}

%adder (u: f32[2,4,4,5]) -> f32[2,4,4,5] {
  %u = f32[2,4,4,5]{3,2,1,0} parameter(0)
  ROOT %m = f32[2,4,4,5]{3,2,1,0} multiply(%u, %u)
}

ENTRY %main (x: f32[2,4,4,3], w: f32[3,3,3,5]) -> f32[2,4,4,5] {
  %x = f32[2,4,4,3]{3,2,1,0} parameter(0)
  %w = f32[3,3,3,5]{3,2,1,0} parameter(1)
  %conv_fusion.7 = f32[2,4,4,5]{3,2,1,0} fusion(%x, %w), kind=kCustom, calls=%outer
  %transpose_copy_fusion.2 = f32[3,4,4,2]{3,2,1,0} fusion(%x), kind=kLoop, calls=%transposer
  %square_fusion = f32[2,4,4,5]{3,2,1,0} fusion(%conv_fusion.7), kind=kLoop, calls=%adder
  ROOT %add.3 = f32[2,4,4,5]{3,2,1,0} add(%square_fusion, %square_fusion)
}
"""


def test_op_kinds_of_a_hand_written_module():
  kinds = op_profile.op_kinds(_HLO)
  assert kinds == {
    "x": "elementwise / reduction",
    "w": "elementwise / reduction",
    "conv_fusion.7": "convolution / dot",  # through two levels of calls
    "transpose_copy_fusion.2": "transpose / copy",
    "square_fusion": "elementwise / reduction",
    "add.3": "elementwise / reduction",
  }


def test_op_kinds_rejects_text_without_entry():
  with pytest.raises(ValueError, match="hlo_text"):
    op_profile.op_kinds("HloModule empty\n")


def _conv_grad():
  def loss(x, w):
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(jax.nn.relu(y) ** 2)

  x = jnp.ones((4, 8, 8, 3))
  w = jnp.ones((3, 3, 3, 5)) * 0.1
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()
  return compiled, x, w


def test_op_kinds_of_a_compiled_conv_gradient():
  compiled, _, _ = _conv_grad()
  text = compiled.as_text()
  kinds = op_profile.op_kinds(text)
  # Forward, input-gradient and weight-gradient convolutions: at least three instructions
  # are (or call) convolutions, whatever XLA fuses them into.
  assert sum(kind == "convolution / dot" for kind in kinds.values()) >= 3
  # Every entry instruction whose own text is a convolution is classified as one.
  for line in text.split("ENTRY", 1)[1].splitlines():
    if " convolution(" in line:
      name = line.split("=", 1)[0].replace("ROOT", "").strip().lstrip("%")
      assert kinds[name] == "convolution / dot"


def test_op_seconds_by_kind_traces_a_compiled_step():
  compiled, x, w = _conv_grad()
  seconds = op_profile.op_seconds_by_kind(lambda: compiled(x, w), compiled.as_text(), steps=2)
  assert set(seconds) == set(op_profile.KINDS)
  assert seconds["convolution / dot"] > 0
  assert all(value >= 0 for value in seconds.values())
  with pytest.raises(ValueError, match="steps"):
    op_profile.op_seconds_by_kind(lambda: compiled(x, w), compiled.as_text(), steps=0)

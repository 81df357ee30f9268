"""``TrainerLike``, what a hook may use of the trainer: the trainer has every member, and the
library's hooks (read from their source) use no other."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import jaxprune
import jaxprune.train as jt

ROOT = Path(jaxprune.__file__).resolve().parent.parent
HOOKS = ("on_fit_start", "on_train_epoch_end", "on_epoch_end", "on_step", "after_epoch")


def _members(protocol: type) -> dict[str, object]:
  """The protocol's members: its annotated attributes, properties and methods."""
  names = {n for n in vars(protocol).get("__annotations__", {}) if not n.startswith("_")}
  names |= {n for n in vars(protocol) if not n.startswith("_")}
  return {n: vars(protocol).get(n) for n in sorted(names)}


MEMBERS = _members(jt.TrainerLike)


def test_the_protocol_names_what_hooks_use():
  assert set(MEMBERS) == {
    "params", "rest", "opt_state", "lr_scale", "model", "tx", "epoch", "step", "history",
    "batch_size", "reference_batch_size", "num_devices", "lr", "replace", "evaluate",
    "set_batch_size", "step_memory", "train_loader",
  }  # fmt: skip


def test_the_trainer_has_every_member(kit):
  trainer = kit.trainer()
  for name, member in MEMBERS.items():
    assert hasattr(trainer, name), name
    if inspect.isfunction(member):
      got = inspect.signature(getattr(trainer, name)).parameters
      want = list(inspect.signature(member).parameters)[1:]  # without self
      assert list(got) == want, name
  # The settable member can be set (here to what it holds); the trained state cannot.
  trainer.lr_scale = trainer.lr_scale
  for name in ("params", "rest", "opt_state"):
    with pytest.raises(AttributeError, match=rf"Trainer.{name} cannot be set: .*replace"):
      setattr(trainer, name, getattr(trainer, name))


def _callback_classes(tree: ast.AST) -> list[ast.ClassDef]:
  def is_callback(base: ast.expr) -> bool:
    name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
    return name == "Callback"

  return [
    node
    for node in ast.walk(tree)
    if isinstance(node, ast.ClassDef) and any(is_callback(b) for b in node.bases)
  ]


def _takes_trainer(node: ast.AST) -> bool:
  if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
    return False
  args = node.args
  return any(a.arg == "trainer" for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))


def _uses(function: ast.AST) -> set[tuple[str, int]]:
  """``(attribute, line)`` of every ``trainer.<attribute>`` and ``getattr`` / ``hasattr`` /
  ``setattr(trainer, "<attribute>", ...)`` in ``function``."""
  found = set()
  for node in ast.walk(function):
    if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "trainer":
      found.add((node.attr, node.lineno))
    elif (
      isinstance(node, ast.Call)
      and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr")
      and len(node.args) >= 2
      and getattr(node.args[0], "id", None) == "trainer"
    ):
      name = node.args[1]
      assert isinstance(name, ast.Constant), f"line {node.lineno}: a computed attribute name"
      found.add((name.value, node.lineno))
  return found


def _scan(folder: str, *, hooks_only: bool) -> tuple[dict[str, set[str]], int]:
  """What the functions of ``folder`` that take a ``trainer`` use of it (``hooks_only``: only
  the methods of ``Callback`` subclasses), by file; and how many hook methods were read."""
  used: dict[str, set[str]] = {}
  hook_methods = 0
  for path in sorted((ROOT / folder).rglob("*.py")):
    tree = ast.parse(path.read_text(), filename=str(path))
    classes = _callback_classes(tree)
    for cls in classes:
      for method in cls.body:
        if isinstance(method, ast.FunctionDef) and method.name in HOOKS:
          hook_methods += 1
          # The scan finds a hook's uses by its parameter's name.
          assert method.args.args[1].arg == "trainer", f"{path}:{method.lineno}"
    scope = classes if hooks_only else [tree]
    for node in (n for top in scope for n in ast.walk(top)):
      if _takes_trainer(node):
        uses = {f"{name} (line {line})" for name, line in _uses(node)}
        used.setdefault(str(path.relative_to(ROOT)), set()).update(uses)
  return used, hook_methods


@pytest.mark.parametrize(("folder", "hooks_only"), [("jaxprune", False), ("experiments", True)])
def test_hooks_use_only_protocol_members(folder, hooks_only):
  used, hook_methods = _scan(folder, hooks_only=hooks_only)
  assert hook_methods >= (10 if folder == "jaxprune" else 2)  # the scan found the hooks
  outside = {
    path: sorted(u for u in uses if u.split(" ")[0] not in MEMBERS) for path, uses in used.items()
  }
  assert not {path: uses for path, uses in outside.items() if uses}
  if folder == "jaxprune":
    names = {u.split(" ")[0] for uses in used.values() for u in uses}
    assert {"model", "opt_state", "replace", "set_batch_size", "step_memory"} <= names


def test_callbacks_does_not_import_the_trainer():
  source = (ROOT / "jaxprune" / "train" / "callbacks.py").read_text()
  assert "TYPE_CHECKING" not in source and "trainer import" not in source

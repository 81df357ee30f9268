"""How the :class:`~jaxprune.train.Trainer` attributes kept on its parts are read and set.

:class:`Part` forwards one; the constants say why those that cannot be set cannot.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DERIVED", "NEW_TRAINER", "PLACED", "STATE", "Part"]


class Part:
  """A :class:`Trainer` attribute kept on one of its parts (the field ``part``).

  Reading it reads the part's. Setting it sets the part's and then calls the part's method
  ``then`` (when given), so that the new value takes effect; an attribute whose new value
  could not take effect has ``fixed``, the reason, and setting it raises ``AttributeError``
  with it instead of being silently ignored.
  """

  def __init__(self, part: str, *, fixed: str | None = None, then: str | None = None):
    self.part, self.fixed, self.then = part, fixed, then

  def __set_name__(self, owner: type, name: str) -> None:
    self.name = name

  def __get__(self, instance: Any, owner: type | None = None) -> Any:
    if instance is None:
      return self
    return getattr(getattr(instance, self.part), self.name)

  def __set__(self, instance: Any, value: Any) -> None:
    if self.fixed is not None:
      raise AttributeError(f"Trainer.{self.name} cannot be set: {self.fixed}")
    part = getattr(instance, self.part)
    setattr(part, self.name, value)
    if self.then is not None:
      getattr(part, self.then)()


# Why the attributes that cannot be set cannot (see Part).
DERIVED = "it follows from the trainer's state"
STATE = (
  "install a new model or optimizer state with Trainer.replace(model, opt_state), and "
  "evaluate other arrays with Trainer.evaluate(loader, params=..., rest=...)"
)
PLACED = "the trained state is placed for it; build a new Trainer with the new value"
NEW_TRAINER = "it was fixed when the trainer was built; build a new Trainer with the new value"

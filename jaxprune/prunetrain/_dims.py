"""Union-find over the dimensions of a traced computation (private to the channel graph).

Every axis of every jaxpr value is a *node* of some size. Operations that must keep two axes'
channels in step (an elementwise add, a conv's input against its kernel's input axis) *unify*
their nodes. A node may also be *expanded* into parts: a product (``"prod"``, major to minor:
a flattened ``(H, W, C)`` axis, a grouped conv's ``(groups, channels per group)``) or a
concatenation (``"cat"``: ``concatenate``, or a slice that splits an axis). Unifying two
expanded nodes aligns their parts, refining one where the other is finer; parts that cannot
be aligned (a reshape that regroups channels) are *marked*. The nodes that are never expanded
are the *atoms*: a channel group is an atom, and every axis maps each of its positions to one
coordinate of each atom it contains (:meth:`_Dims.coords`).

A mark says why an atom cannot be pruned: ``(kind, reason)`` with kind ``"fixed"`` (the
model's input / output, a spatial axis, a constant), ``"normalized"`` (a statistic over the
channels: removing one changes the others) or ``"unfollowed"`` (an operation the graph cannot
follow). Marks on an expanded node reach every atom inside it.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

Mark = tuple[str, str]


class _Dims:
  """Nodes, their union-find classes, expansions and marks."""

  def __init__(self) -> None:
    self._parent: list[int] = []
    self._size: list[int] = []
    self._expansion: dict[int, tuple[str, tuple[int, ...]]] = {}
    self._marks: dict[int, list[Mark]] = {}

  # -- nodes -----------------------------------------------------------------------------------
  def new(self, size: int, mark: Optional[Mark] = None) -> int:
    node = len(self._parent)
    self._parent.append(node)
    self._size.append(int(size))
    if mark is not None:
      self._marks[node] = [mark]
    return node

  def size(self, node: int) -> int:
    return self._size[node]

  def find(self, node: int) -> int:
    root = node
    while self._parent[root] != root:
      root = self._parent[root]
    while self._parent[node] != root:  # path compression
      self._parent[node], node = root, self._parent[node]
    return root

  def expansion(self, node: int) -> Optional[tuple[str, tuple[int, ...]]]:
    return self._expansion.get(self.find(node))

  def mark(self, node: int, mark: Mark) -> None:
    self._marks.setdefault(self.find(node), []).append(mark)

  def composite(self, kind: str, parts: list[int]) -> int:
    """A node equal to ``parts`` multiplied out (``"prod"``) or concatenated (``"cat"``).

    Trivial parts (size 1 in a product, size 0 in a concatenation) are dropped, and one
    remaining part is returned itself.
    """
    empty = 1 if kind == "prod" else 0
    parts = [p for p in parts if self.size(p) != empty]
    if len(parts) == 1:
      return parts[0]
    sizes = [self.size(p) for p in parts]
    node = self.new(math.prod(sizes) if kind == "prod" else sum(sizes))
    if parts:
      self._expansion[node] = (kind, tuple(parts))
    return node

  # -- unification -----------------------------------------------------------------------------
  def unify(self, a: int, b: int, reason: str) -> None:
    """Make ``a`` and ``b`` one class (their channels must be pruned together)."""
    ra, rb = self.find(a), self.find(b)
    if ra == rb:
      return
    if self._size[ra] != self._size[rb]:
      for root in (ra, rb):
        self.mark(root, ("unfollowed", f"{reason}: axes of sizes {self._size[ra]} and "
                         f"{self._size[rb]} meet"))
      return
    ea, eb = self._expansion.pop(ra, None), self._expansion.pop(rb, None)
    self._parent[rb] = ra
    marks = self._marks.pop(rb, [])
    if marks:
      self._marks.setdefault(ra, []).extend(marks)
    if ea is not None and eb is not None:
      self._expansion[ra] = ea
      self._align(ea, eb, reason)
    elif ea is not None or eb is not None:
      self._expansion[ra] = ea if ea is not None else eb

  def _align(self, ea: tuple, eb: tuple, reason: str) -> None:
    """Unify two expansions of one node part by part, refining the coarser side."""
    (kind_a, parts_a), (kind_b, parts_b) = ea, eb
    if kind_a != kind_b:
      self._refuse(parts_a + parts_b, f"{reason}: an axis both concatenated and flattened")
      return
    grow = math.prod if kind_a == "prod" else sum
    a, b = list(parts_a), list(parts_b)
    i = j = 0
    while i < len(a) and j < len(b):
      if self.size(a[i]) == self.size(b[j]):
        self.unify(a[i], b[j], reason)
        i, j = i + 1, j + 1
        continue
      # The larger part must equal a run of the other side's parts.
      (big, bi), (small, si) = ((a, i), (b, j)) if self.size(a[i]) > self.size(b[j]) else ((b, j), (a, i))
      end = si + 1
      while end <= len(small) and grow(self.size(p) for p in small[si:end]) < self.size(big[bi]):
        end += 1
      if end > len(small) or grow(self.size(p) for p in small[si:end]) != self.size(big[bi]):
        self._refuse(big[bi:] + small[si:], f"{reason}: channel axes regrouped")
        return
      self.unify(big[bi], self.composite(kind_a, small[si:end]), reason)
      if big is a:
        i, j = i + 1, end
      else:
        i, j = end, j + 1
    if i < len(a) or j < len(b):
      self._refuse(a[i:] + b[j:], f"{reason}: channel axes regrouped")

  def _refuse(self, nodes: list[int], reason: str) -> None:
    for node in nodes:
      self.mark(node, ("unfollowed", reason))

  # -- read-out --------------------------------------------------------------------------------
  def atoms(self, node: int) -> list[int]:
    """The atoms inside ``node``, in order (an atom is its own list)."""
    exp = self.expansion(node)
    if exp is None:
      return [self.find(node)]
    return [atom for part in exp[1] for atom in self.atoms(part)]

  def atom_marks(self) -> dict[int, list[Mark]]:
    """Every marked atom -> its marks and those of every expanded node that contains it."""
    inherited: dict[int, list[Mark]] = {}
    for root, marks in list(self._marks.items()):
      if self.find(root) != root:
        continue
      for atom in self.atoms(root):
        inherited.setdefault(atom, []).extend(marks)
    return inherited

  def coords(self, node: int) -> dict[int, np.ndarray]:
    """For every atom inside ``node``: the atom's channel at each position of the axis.

    -1 where the position lies in another part of a concatenation.

    Raises:
      ValueError: one atom appears twice in one product (the axis cannot be sliced per
        channel).
    """
    size = self.size(node)
    exp = self.expansion(node)
    if exp is None:
      return {self.find(node): np.arange(size)}
    kind, parts = exp
    out: dict[int, np.ndarray] = {}
    if kind == "prod":
      sizes = [self.size(p) for p in parts]
      position = np.arange(size)
      for k, part in enumerate(parts):
        digit = (position // math.prod(sizes[k + 1 :])) % sizes[k]
        for atom, sub in self.coords(part).items():
          if atom in out:
            raise ValueError("an atom appears twice in one flattened axis")
          out[atom] = sub[digit]
      return out
    offset = 0
    for part in parts:
      part_size = self.size(part)
      for atom, sub in self.coords(part).items():
        column = out.setdefault(atom, np.full(size, -1))
        column[offset : offset + part_size] = sub
      offset += part_size
    return out

"""A registry of named entries, each selected by one config key: the algorithms
(``learner.advantage``), the objectives (``learner.objective``) and the token methods
(``learner.entropy_mask.kind`` / ``learner.entropy_method.kind``) are each one :class:`Registry`.

A config's value is validated against the registry itself (:meth:`Registry.entry`), so the
names a check accepts, the names the config reference lists and the entries that exist cannot
drift apart.
"""

from __future__ import annotations

from typing import Generic, TypeVar

Entry = TypeVar("Entry")


class Registry(dict[str, Entry], Generic[Entry]):
  """Entries by name (a ``dict``: iterate, ``in``, ``sorted`` as usual).

  Attributes:
    key: the config key whose value names an entry, e.g. ``learner.advantage``.
    kind: what an entry is, in messages, e.g. ``algorithm``.
  """

  def __init__(self, key: str, kind: str):
    super().__init__()
    self.key = key
    self.kind = kind

  def add(self, name: str, entry: Entry) -> Entry:
    """Registers ``entry`` under ``name`` and returns it; a name taken by another entry is an
    error (registering the same entry again is not: a module imported twice)."""
    if name in self and self[name] is not entry:
      taken = getattr(self[name], "__qualname__", None) or repr(self[name])
      raise ValueError(f"{self.kind} {name!r} is registered already ({taken})")
    self[name] = entry
    return entry

  def entry(self, name: str) -> Entry:
    """The entry named ``name``; ``ValueError`` naming the config key and the names there are."""
    if name not in self:
      raise ValueError(f"{self.key}={name!r} is not one of {sorted(self)}")
    return self[name]

"""The one plugin registry of ckptstore, in the style of fsspec's ``registry.py``: the formats
(``formats/__init__.py``) and the storage backends (``storage/registry.py``) are each an instance.

``known`` maps a name to ``{"class": "module:Class", "err": install hint}`` (imported only when
first used); ``register`` adds or replaces one at runtime (a class, or its ``"module:Class"``);
third-party packages declare theirs in the registry's entry-point group::

    [project.entry-points."ckptstore.formats"]
    myformat = "mypkg.ckpt:MyFormat"
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

from .errors import CheckpointError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> class. ``kind`` names an entry in messages ("format", "storage"); ``label(name)``
    says what failed to import ("checkpoint format 'x'", "the storage for s3://")."""

    def __init__(
        self,
        kind: str,
        group: str,
        known: dict[str, dict[str, str]],
        label: Callable[[str], str],
        methods: tuple[str, ...] = (),
    ) -> None:
        self.kind, self.group, self.known, self.label = kind, group, known, label
        self.methods = methods  # what a class of this registry must have (its protocol)
        self.loaded: dict[str, T] = {}  # imported (or registered as a class) once
        self._builtin = frozenset(known)
        self._builtin_target = {name: spec["class"] for name, spec in known.items()}

    def register(self, name: str, cls: T | str, *, clobber: bool = False, errtxt: str = "") -> None:
        """``cls`` (a class, or ``"module:Class"`` imported when first used) as ``name``;
        ``errtxt``: the install hint when it cannot be imported."""
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{self.kind} name {name!r} must be letters, digits, '-' or '_'")
        if not clobber and self._taken_by_another(name, cls):
            current = self.loaded.get(name) or self.known[name]["class"]
            raise ValueError(
                f"{self.kind} {name!r} is already registered ({current}); pass clobber=True to "
                "replace it"
            )
        if isinstance(cls, str):
            if ":" not in cls:
                raise ValueError(f"{self.kind} class must be 'module:Class', got {cls!r}")
            self.known[name] = {"class": cls, **({"err": errtxt} if errtxt else {})}
            self.loaded.pop(name, None)
        else:
            self.loaded[name] = cls
            if errtxt:
                self.known[name] = {"class": _dotted(cls), "err": errtxt}

    def _taken_by_another(self, name: str, cls: T | str) -> bool:
        current: Any = self.loaded.get(name)
        if current is None and name in self.known:
            current = self.known[name]["class"]
        if current is None:
            return False
        return current is not cls and current != cls and _dotted(current) != _dotted(cls)

    def names(self) -> list[str]:
        """Every name: built in, registered, or declared by an installed package."""
        found = set(self.known) | set(self.loaded)
        found.update(ep.name for ep in entry_points(group=self.group))
        return sorted(found)

    def hint(self, name: str) -> str | None:
        return self.known.get(name, {}).get("err")

    def find(self, name: str) -> T | None:
        """The class registered as ``name`` (imported on first use, then cached); None when
        nobody registered that name."""
        if name in self.loaded:
            return self.loaded[name]
        spec = self.known.get(name)
        target = spec["class"] if spec else None
        if target is None:
            eps = [ep for ep in self._foreign() if ep.name == name]
            if not eps:
                return None
            if len(eps) > 1 or name in self._builtin:
                raise PluginError(self._collision(name, eps))
            cls = self.checked(eps[0])
        else:
            cls = self.load(target, name)
        self.loaded[name] = cls
        return cls

    def check(self) -> None:
        """Every installed entry point of this registry imports, is a class of its protocol
        and has a name of its own; else PluginError, one line naming the entry point and its
        distribution. What a program calls at its start, before any work."""
        by_name: dict[str, list[EntryPoint]] = {}
        for ep in self._foreign():
            by_name.setdefault(ep.name, []).append(ep)
        for name, eps in sorted(by_name.items()):
            if len(eps) > 1 or name in self._builtin:
                raise PluginError(self._collision(name, eps))
            self.checked(eps[0])

    def _foreign(self) -> list[EntryPoint]:
        """The group's entry points, less ckptstore's own declarations of its built-ins, one
        per (name, target, distribution): a distribution found twice on the path is one."""
        out: dict[tuple[str, str, str], EntryPoint] = {}
        for ep in entry_points(group=self.group):
            if ep.name in self._builtin and self._builtin_target.get(ep.name) == ep.value:
                continue
            out.setdefault((ep.name, ep.value, _dist(ep)), ep)
        return list(out.values())

    def checked(self, ep: EntryPoint) -> T:
        """The class ``ep`` names, imported and checked against the protocol."""
        where = f"entry point {ep.name!r} = {ep.value!r} in {self.group!r} of {_dist(ep)}"
        try:
            cls = ep.load()
        except Exception as e:  # a plugin's import may raise anything
            raise PluginError(
                f"the {self.kind} plugin {where} fails to import ({type(e).__name__}: "
                f"{_first(e)}): fix or uninstall that distribution"
            ) from None
        missing = [m for m in self.methods if not callable(getattr(cls, m, None))]
        if not isinstance(cls, type) or missing:
            what = "is not a class" if not isinstance(cls, type) else f"lacks {', '.join(missing)}"
            raise PluginError(
                f"the {self.kind} plugin {where} {what} (a {self.kind} plugin is a class with "
                f"{', '.join(self.methods)}): fix or uninstall that distribution"
            )
        return cls  # type: ignore[return-value]

    def _collision(self, name: str, eps: list[EntryPoint]) -> str:
        who = " and ".join(f"{ep.value!r} of {_dist(ep)}" for ep in eps)
        clash = f"ckptstore's own {self.kind}" if name in self._builtin else "each other"
        return (
            f"the {self.kind} name {name!r} in {self.group!r} is declared by {who}, which "
            f"collides with {clash}: uninstall one, or rename its entry point"
        )

    def load(self, target: str, name: str) -> T:
        """Import ``"module:Class"``; CheckpointError with the install hint if it cannot be."""
        module_name, _, attr = target.partition(":")
        try:
            cls: T = getattr(importlib.import_module(module_name), attr)
        except ImportError as e:
            hint = self.hint(name) or f"install the package that provides {module_name}"
            raise CheckpointError(f"cannot load {self.label(name)}: {hint} ({e})") from e
        return cls


class PluginError(CheckpointError):
    """An installed plugin (an entry point) is broken: it fails to import, is not a class of
    its registry's protocol, or its name collides. A setting error: exit 2, at the start."""


def _dist(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "an unknown distribution"
    return f"the distribution {dist.metadata['Name']} {dist.version}"


def _first(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return text if len(text) <= 160 else text[:157] + "..."


def _dotted(cls: Any) -> str:
    if isinstance(cls, str):
        return cls
    return f"{cls.__module__}:{getattr(cls, '__qualname__', type(cls).__qualname__)}"

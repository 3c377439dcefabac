"""The registry of backends: built-ins at import, custom ones through register_backend."""

from __future__ import annotations

import threading

from .backends import Backend, builtin_backends

_lock = threading.Lock()
_backends: dict[str, Backend] = {}
_order: list[str] = []  # the built-in default order, custom backends included
_version = 0


def _bump() -> None:
    global _version
    _version += 1


def registry_version() -> int:
    return _version


def register_backend(backend: Backend, priority: int | str | None = None, *, replace: bool = False) -> None:
    """Add a Backend instance to the default order.

    priority: an index into the order, "first", "last", or None (just before `math`,
    so a custom backend is tried before the reference). replace=True swaps a backend
    of the same name in place.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be an attention_dispatch.Backend instance, got {type(backend).__name__}")
    name = backend.name
    if not isinstance(name, str) or not name or name != name.lower() or not name.replace("_", "").isalnum():
        raise ValueError(f"backend name must be a non-empty lowercase identifier, got {name!r}")
    with _lock:
        if name in _backends and not replace:
            raise ValueError(f"a backend named {name!r} is already registered (pass replace=True to swap it)")
        if name in _backends:
            _backends[name] = backend
            _bump()
            return
        if priority is None:
            references = [i for i, n in enumerate(_order) if _backends[n].reference]
            index = references[0] if references else len(_order)
        elif priority == "first":
            index = 0
        elif priority == "last":
            index = len(_order)
        elif isinstance(priority, int) and not isinstance(priority, bool):
            index = priority
        else:
            raise ValueError(f"priority must be an int index, 'first', 'last' or None, got {priority!r}")
        _backends[name] = backend
        _order.insert(index, name)
        _bump()


def unregister_backend(name: str) -> Backend:
    """Remove a backend by name and return it."""
    with _lock:
        if name not in _backends:
            raise KeyError(f"no backend named {name!r}; registered: {', '.join(_order)}")
        _order.remove(name)
        _bump()
        return _backends.pop(name)


def list_backends() -> list[str]:
    """Names of the registered backends in default priority order."""
    return list(_order)


def find_backend(name: str) -> Backend | None:
    """The backend named `name`, or None (one lookup: no race with unregister_backend)."""
    return _backends.get(name)


def get_backend(name: str) -> Backend:
    try:
        return _backends[name]
    except KeyError:
        raise KeyError(f"no backend named {name!r}; registered: {', '.join(_order)}") from None


def _register_builtins() -> None:
    for backend in builtin_backends():
        register_backend(backend, "last")


_register_builtins()

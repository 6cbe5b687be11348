"""The modules that became private: each old name still imports, and any name taken from it
raises an :class:`ImportError` that names the new home, instead of a bare ``No module named``
or ``cannot import name``."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["private_since"]


def private_since(old: str, new: str) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``old``, whose statements moved to the private ``new``."""

    def __getattr__(name: str) -> object:
        if name.startswith("__"):  # what tools probe (__path__, __wrapped__, ...)
            raise AttributeError(name)
        raise ImportError(
            f"{old}.{name}: {old} is private since 0.1.0; its statements are in {new}, the "
            "query layer, which any release may change. Use sqla_jobs' operations (claim, "
            "complete, queue_stats, ...), or open an issue for what you need from it",
            name=old,
        )

    return __getattr__

"""Names a package keeps importable outside its ``__all__``, imported on first use."""

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(
    package: str, namespace: dict, where: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's module ``__getattr__`` and ``__dir__`` for the names in ``where`` (name ->
    the module that defines it): each is imported when first asked for, then kept in the
    package's ``namespace`` (its ``globals()``), so that the package's narrow ``__all__`` does
    not break code that imports the other names from it."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__

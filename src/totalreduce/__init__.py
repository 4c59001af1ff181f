"""totalreduce: data-parallel collectives for deep-learning training.

The numpy-level API (``api.py``) mirrors Horovod's names, so porting a script means
changing the import: ``import totalreduce as tr``, then ``tr.init()``, ``tr.allreduce(x)``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__ as __version__

if TYPE_CHECKING:
    from .api import *  # noqa: F403
    from .api import __all__ as __all__


def __getattr__(name: str) -> Any:
    # The API, numpy and the engine load on first use: the launcher (totalrun, python -m
    # totalreduce.run) imports this package too, and started 0.2 s later with them, before
    # every job's first rank.
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    api = importlib.import_module(f"{__name__}.api")  # `from . import` would recurse here
    if name in globals():  # the API module itself, or a submodule its import brought in
        return globals()[name]
    try:
        value = getattr(api, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    api = importlib.import_module(f"{__name__}.api")
    return sorted(set(globals()) | set(api.__all__))

"""Warnings raised inside an update, delivered to whoever runs it.

The trainer shows an update's warnings on its progress bar, tagged with the iteration
("[iteration 12] warning: ..."). Capturing them with ``warnings.catch_warnings`` would
swap the process-wide warning filters, which is not safe where the trainer runs on a
thread (``Agent.local``). So an update calls ``warn`` here instead of ``warnings.warn``:
the message goes to the handler that the current thread (strictly, the current
``contextvars`` context) installed with ``warnings_to``, and only where none is installed
to ``warnings.warn``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

WarningHandler = Callable[[str, type[Warning]], None]
"""Called with a warning's message and category."""

_handler: ContextVar[WarningHandler | None] = ContextVar("trustrl_warning_handler", default=None)


def warn(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category, stacklevel)``, unless a handler is installed in
    this context: then the handler alone gets it."""
    handler = _handler.get()
    if handler is None:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    else:
        handler(message, category)


@contextmanager
def warnings_to(handler: WarningHandler) -> Iterator[None]:
    """Within the block, ``warn`` in this context calls ``handler``."""
    token = _handler.set(handler)
    try:
        yield
    finally:
        _handler.reset(token)

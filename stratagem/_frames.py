"""Which stack frames are the user's: where a warning should point, what a remote traceback shows.

A frame is the user's when its file is none of: stratagem's own modules, the standard
library (``threading``, ``concurrent.futures``, frozen modules), installed packages
(``site-packages`` / ``dist-packages``: torch, grpc, cloudpickle...). What is left is the
training script and the modules beside it -- and code typed into a console or notebook
(``<stdin>``, ``<ipython-input-...>``).

Example::

    import threading, stratagem
    from stratagem._frames import is_users
    assert is_users("/home/me/train.py") and is_users("<stdin>")
    assert not is_users(threading.__file__) and not is_users(stratagem.__file__)
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings

__all__ = ["PACKAGE_DIR", "is_users", "warn_at_users_line"]

#: stratagem's package folder, with a trailing separator.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")})
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def is_users(filename: str) -> bool:
    """Whether code of ``filename`` (a frame's ``co_filename``) is the user's, not a library's."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen")
    path = os.path.abspath(filename)
    return not (path.startswith(PACKAGE_DIR) or path.startswith(_STDLIB)
                or any(marker in path for marker in _INSTALLED))


def warn_at_users_line(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` shown at the innermost line of the user's code
    on the stack (the caller's line when there is none, as in a server's thread)."""
    frame, stacklevel = sys._getframe(1), 2
    while frame is not None and not is_users(frame.f_code.co_filename):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(message, category, stacklevel=stacklevel if frame is not None else 2)

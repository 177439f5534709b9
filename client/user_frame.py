"""Which stack frame is the user's: the line a warning names.

remat's warnings are raised deep inside remat and torch (a model's forward, a backward hook, a lookup called
by another), at depths that vary with the path taken and with torch's version (dynamo's frames), so a fixed
``stacklevel`` names remat's own lines on some paths. Walking the stack to the first frame that is neither
torch's nor remat.client's names the user's line on every path.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

__all__ = ["user_stacklevel"]

_OWN = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parent))


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in the function calling this: its first caller outside torch and
    remat.client; 1 (that function) where there is none, as in a hook run on the autograd engine's device
    threads."""
    frame, level = inspect.currentframe(), 0
    while frame is not None:
        if level >= 1 and not frame.f_code.co_filename.startswith(_OWN):
            return level
        frame, level = frame.f_back, level + 1
    return 1

"""Where execpool itself is installed: the caller puts its parent on the
workers' path, a sandboxed tool may read it (warm jobs run its code, the
tool layer's shim lives in it), and whether the workers' C extension was
built is read off it without importing anything of the worker's."""

from __future__ import annotations

import importlib.machinery
import os

#: The ``execpool`` package directory, and the directory that holds it.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_PARENT = os.path.dirname(PACKAGE_DIR)


def has_spawn_extension() -> bool:
    """Whether the C extension (execpool/tool/_spawn.c) was built here.
    Looked for as a file: importing (or even finding) it would import the
    tool's package into the caller."""
    folder = os.path.join(PACKAGE_DIR, "tool")
    return any(os.path.isfile(os.path.join(folder, "_spawn" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)

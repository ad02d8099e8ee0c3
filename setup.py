"""The one compiled piece, execpool._spawn, is optional: where it cannot be
built, workers start tools with a Python-level fork instead (slower, same
guarantees)."""

import sys

from setuptools import Extension, setup

extensions = []
if sys.platform.startswith("linux"):
    extensions.append(Extension("execpool.tool._spawn", ["execpool/tool/_spawn.c"], optional=True))

setup(ext_modules=extensions)

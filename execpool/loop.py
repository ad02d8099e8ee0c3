"""``execpool.loop``, the tool-calling loop, under the name it has always
had: this module is execpool/agent/loop.py itself (the same module
object)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("execpool.agent.loop")

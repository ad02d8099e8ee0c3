"""``execpool.tools``, the model-facing tool layer, under the name it has
always had: this module is execpool/agent/tools.py itself (the same
module object, so setting one of its values is seen there)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("execpool.agent.tools")

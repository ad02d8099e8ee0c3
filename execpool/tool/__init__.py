"""The tool's process: the code that runs in the process that becomes a
tool, or an interpreter beside untrusted code -- what a new process does
to itself before the tool's first instruction (become.py, and the C
extension _spawn.c), the warm template and the spares it clones
(template.py, spare.py, and spare_wire.py, the words between a spare and
its worker), the session runtimes (python_session.py, session_fork.py,
bash_session.sh) and the tool layer's shim (shim/sitecustomize.py).

Whatever runs here shares its process with the user's code, which may
read its memory and call its functions: it holds no secret of the
worker's or the caller's, and imports only execpool/shared and itself
(tests/test_layout.py).
"""

import os

#: execpool's own code -- the session runtimes, the tool layer's /mnt/data
#: shim -- whose frames a cell's traceback leaves out: the package's
#: directory (not the one holding it, site-packages, whose libraries'
#: frames are the cell's to see).
OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

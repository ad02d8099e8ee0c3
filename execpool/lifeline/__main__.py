"""``python -m execpool.lifeline FD``: the pool's lifeline process
(execpool/lifeline/process.py), its socket to the owner on FD."""

import sys

from .process import main

main(sys.argv[1:])

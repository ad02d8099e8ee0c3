"""``python -m execpool.worker READ_FD WRITE_FD``: a worker process
(execpool/worker/loop.py), started by the pool's lifeline."""

import sys

from .loop import main

main(sys.argv[1:])

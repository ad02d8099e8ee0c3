"""``python -m execpool.worker READ_FD WRITE_FD``: a worker process
(execpool/worker/event_loop.py), started by the pool's lifeline."""

import sys

from .event_loop import main

main(sys.argv[1:])

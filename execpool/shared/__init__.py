"""What every process of a pool may import: job specs and results
(jobs.py, result.py, checks.py, output.py, errors.py), the wire between the
caller and a worker (worker_wire.py) and between the owner and its lifeline
(lifeline_wire.py), and the kernel mechanisms (kernel/). Nothing here
imports the caller's side or the worker's."""

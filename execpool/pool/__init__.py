"""The pool as the caller's process runs it: ``ExecPool`` (supervisor.py),
its configuration, the one dispatcher thread, the worker processes as the
caller sees them, the owner's handle on the lifeline, futures and events,
streams and ``map`` built on ``submit``. Imports execpool/shared and nothing
of the worker's."""

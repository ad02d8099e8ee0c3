"""The supervisor's parts, in the caller's process: its configuration, the
one dispatcher thread, the worker processes as the caller sees them, the
owner's handle on the lifeline, futures and events, and the layers built on
``submit`` (``map``, code jobs, sessions, workspaces). ``ExecPool`` itself is
execpool/supervisor.py and the parent-side stream execpool/drain.py, the
design card's modules. Imports execpool/shared and nothing of the worker's."""

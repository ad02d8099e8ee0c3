"""How the sandbox is done -- apart from what a caller asks of it
(``Sandbox`` and what the machine offers: execpool/shared/kernel/sandbox.py).

Only the worker and the tool's process load this folder: the view
(view.py, a worker's template and each job's own mounts), the Landlock
rules (rulesets.py), the seccomp filter (seccomp.py), and entering them in
the tool's new process (enter.py). It imports only execpool/shared
(tests/test_layout.py); the parts made ahead of a job, which need the
worker's helpers, are the worker's (execpool/worker/preparer.py, space.py,
userns.py).
"""

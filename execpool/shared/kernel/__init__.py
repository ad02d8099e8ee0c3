"""The kernel mechanisms every process may use: the Linux calls Python
lacks (linux.py), process trees and their one kill path (proctree.py),
cgroups (cgroups.py), the sandbox and its seccomp filter (sandbox.py,
seccomp.py), and removing a directory a job filled (dirs.py)."""

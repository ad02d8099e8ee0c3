"""The ``/mnt/data`` remap, run inside a Python tool's own interpreter at
startup: ``site`` imports it because execpool's tool layer puts this directory
first on the tool's ``PYTHONPATH``.

Models trained on hosted code interpreters save their work to ``/mnt/data``
or to other absolute directories that do not exist here, and would lose a
whole computation to the final ``open``. This shim sends those paths to the
working directory -- the cwd at interpreter start, the session's directory --
and says so on stderr:

- ``open``/``io.open`` (so pathlib's ``open``, ``read_*`` and ``write_*``),
  ``os.stat`` (so ``exists``/``is_dir``, which pandas checks before it
  writes), ``os.mkdir`` and ``os.makedirs`` on ``/mnt/data/...``, with one
  notice per process. A read or stat goes to the working directory only when
  the file is there, so a missing file fails under the name the code used,
  which is the name the tool layer's missing-path hint reports.
- A write to an absolute path whose directory does not exist goes to its
  basename in the working directory, with a notice per path.

Nothing else changes: ``os.listdir``, reads of other missing paths and every
other call behave as without the shim. A failure inside the shim falls back
to the original call, the shim's frames are dropped from tracebacks printed
for uncaught exceptions, and the shim takes its directory off ``sys.path``
and ``PYTHONPATH`` so the program and its subprocesses see the environment
they would see without it. A ``sitecustomize`` this one shadows still runs.

This file must stay importable by any Python 3 a pool is configured with, and
cheap: it runs before every Python tool.
"""

import builtins
import functools
import io
import os
import stat
import sys

MNT_DATA = "/mnt/data"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _install():
    workdir = os.getcwd()
    workdir_prefix = workdir.rstrip("/") + "/"
    # A machine that really has /mnt/data keeps it.
    remap_mnt = not os.path.isdir(MNT_DATA)
    real_stat = os.stat
    told = set()
    EXISTS = object()

    def tell(key, message):
        # To the process's stderr even if the program redirected sys.stderr:
        # the model must see where its file went.
        if key in told:
            return
        told.add(key)
        stderr = sys.__stderr__
        try:
            if stderr is not None:
                stderr.write("[execpool] " + message + "\n")
                stderr.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stderr: the program's own business
            pass

    def tell_mnt():
        tell(MNT_DATA, "/mnt/data does not exist in this sandbox: paths under it are mapped to the "
                       "working directory (%s). Use relative paths." % workdir)

    def is_dir(path):
        try:
            return stat.S_ISDIR(real_stat(path).st_mode)
        except (OSError, ValueError):
            return False

    def exists(path):
        try:
            real_stat(path)
        except (OSError, ValueError):
            return False
        return True

    def absolute(file):
        """``file`` as an absolute str path; None for fds, bytes and relative paths."""
        if isinstance(file, (str, os.PathLike)):
            path = os.fspath(file)
            if isinstance(path, str) and path.startswith("/"):
                return path
        return None

    def mnt_target(path):
        """The working-directory path for ``path`` under /mnt/data, else None."""
        if not remap_mnt or path is None or "/mnt" not in path:
            return None
        norm = os.path.normpath(path)
        if norm == MNT_DATA:
            return workdir
        if norm.startswith(MNT_DATA + "/"):
            return os.path.join(workdir, norm[len(MNT_DATA) + 1:])
        return None

    def open_target(file, args, kwargs):
        path = absolute(file)
        if path is None:
            return file
        mode = args[0] if args else kwargs.get("mode", "r")
        writing = isinstance(mode, str) and any(c in mode for c in "wax+")
        target = mnt_target(path)
        if target is not None:
            if writing or exists(target):
                tell_mnt()
                return target
            return file
        parent, name = os.path.split(os.path.normpath(path))
        if (writing and name and not is_dir(parent)
                and not (parent + "/").startswith(workdir_prefix)):
            tell(path, "%s does not exist in this sandbox: writing %r in the working directory "
                       "(%s) instead. Use relative paths." % (parent, name, workdir))
            return os.path.join(workdir, name)
        return file

    def stat_target(path, args, kwargs):
        target = mnt_target(absolute(path))
        if target is not None and exists(target):
            tell_mnt()
            return target
        return path

    def mkdir_target(path, args, kwargs):
        """/mnt/data itself stands for the working directory, which exists:
        creating it is a no-op (``EXISTS``)."""
        target = mnt_target(absolute(path))
        if target is None:
            return path
        tell_mnt()
        return EXISTS if target == workdir else target

    def shim(real, retarget, first):
        """``real`` with its first argument (named ``first``) retargeted."""

        def call(*args, **kwargs):
            target = None
            try:
                if args:
                    target = retarget(args[0], args[1:], kwargs)
                    args = (target,) + args[1:]
                else:
                    target = retarget(kwargs[first], (), kwargs)
                    kwargs[first] = target
            except Exception:  # noqa: BLE001 - the remap never breaks a call: the original call, unchanged
                pass
            if target is EXISTS:
                return None
            try:
                return real(*args, **kwargs)
            except BaseException:
                hide_frames()
                raise

        return functools.update_wrapper(call, real)

    def without_shim_frames(tb):
        head = last = None
        while tb is not None:
            if tb.tb_frame.f_code is not shim_code:
                if last is None:
                    head = tb
                else:
                    last.tb_next = tb
                last = tb
            tb = tb.tb_next
        if last is not None:
            last.tb_next = None
        return head

    installed_hook: list = []

    def hide_frames():
        """An error went through a shim frame: make the uncaught-exception
        hook print the traceback it would print without the shim. Installed
        only then, so a program that never fails here keeps its hook as is."""
        try:
            if installed_hook and sys.excepthook is installed_hook[0]:
                return
            previous = sys.excepthook

            def hook(exc_type, exc, tb):
                try:
                    tb = without_shim_frames(tb)
                    pending, seen = [exc], set()
                    while pending:
                        e = pending.pop()
                        if isinstance(e, BaseException) and id(e) not in seen:
                            seen.add(id(e))
                            e.__traceback__ = without_shim_frames(e.__traceback__)
                            pending += [e.__cause__, e.__context__]
                except Exception:  # noqa: BLE001 - the traceback as it was, rather than none
                    pass
                previous(exc_type, exc, tb)

            installed_hook[:] = [hook]
            sys.excepthook = hook
        except Exception:  # noqa: BLE001 - tracebacks keep the shim's frames, nothing worse
            pass

    shim_open = shim(io.open, open_target, "file")
    shim_code = shim_open.__code__
    builtins.open = io.open = shim_open
    os.stat = shim(os.stat, stat_target, "path")
    os.mkdir = shim(os.mkdir, mkdir_target, "path")
    os.makedirs = shim(os.makedirs, mkdir_target, "name")


def _leave_no_trace():
    """Take this directory off ``sys.path`` and ``PYTHONPATH``: the program
    imports nothing from here and its subprocesses run without the shim."""
    sys.path[:] = [p for p in sys.path if os.path.normpath(p or ".") != _HERE]
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    rest = [p for p in entries if os.path.normpath(p or ".") != _HERE]
    if rest != entries:
        if any(rest):
            os.environ["PYTHONPATH"] = os.pathsep.join(rest)
        else:
            del os.environ["PYTHONPATH"]


def _run_shadowed_sitecustomize():
    """Run the ``sitecustomize`` this module hides (a distribution's or a
    virtualenv's), as ``site`` would have; its errors are reported by
    ``site`` as they would be without the shim."""
    import importlib.machinery

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = type(sys)(spec.name)
    module.__file__ = spec.origin
    module.__spec__ = spec
    module.__loader__ = spec.loader
    spec.loader.exec_module(module)


try:
    _install()
    _leave_no_trace()
except Exception:  # noqa: BLE001 - no remap rather than a broken interpreter
    pass
_run_shadowed_sitecustomize()

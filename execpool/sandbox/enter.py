"""Entering the sandbox: what a tool's new process does to confine itself
for good, before the job's first instruction -- its view, no new
privileges, no capabilities, the Landlock layers, the seccomp filter.

Runs in the process that becomes a tool: after a Python fork
(execpool/tool/become.py), in a warm spare, and in a sandboxed session's
copy (execpool/tool/session_fork.py). The C extension
(execpool/tool/_spawn.c) takes the same steps after its vfork, given
:func:`child_arguments`. What the sandbox allows and why is
execpool/shared/kernel/sandbox.py.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional, Tuple

from ..shared.kernel import linux
from ..shared.kernel.sandbox import errno_error, syscall
from .seccomp import PROGRAM

_libc = ctypes.CDLL(None, use_errno=True)

_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID, _MS_NODEV = 0x2, 0x4
_AT_FDCWD, _AT_RECURSIVE, _AT_EMPTY_PATH = -100, 0x8000, 0x1000
_MOUNT_ATTR_RDONLY = 1
_OPEN_TREE_CLONE, _MOVE_MOUNT_F_EMPTY_PATH = 1, 0x4
_SYS_LANDLOCK_RESTRICT_SELF = 446

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442

class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]




#: The filter's bytes stay alive here; the C extension gets the same bytes.
_program_buffer = ctypes.create_string_buffer(PROGRAM, len(PROGRAM))
_fprog = _SockFprog(len(PROGRAM) // 8, ctypes.cast(_program_buffer, ctypes.c_void_p).value)


#: The steps of a job's view, as execpool/tool/_spawn.c numbers them
#: (execpool/sandbox/view.py makes them, and says what each is for): clone a
#: path of the worker's (writable or read-only) for a later attach, an
#: empty tmpfs (with the options ``b``), a directory (and its parents),
#: attach the clone numbered ``a`` on ``b``, detach what covers a hidden
#: path the job names, clone a path of the view (to attach it again), an
#: empty file (and its parents), text written to a file before the
#: namespace is entered (a copy's id maps), clone the directory ``a`` of
#: the job's space (execpool/worker/space.py).
(STEP_CLONE_RW, STEP_CLONE_RO, STEP_TMPFS, STEP_MKDIR, STEP_ATTACH, STEP_UNCOVER, STEP_SAVE, STEP_TOUCH, STEP_WRITE,
 STEP_SPACE) = range(1, 11)
#: How a view's mount namespace is had (_spawn.c says the same): the
#: template's copied, the job's own made ahead and entered, or a sandboxed
#: session's copy's entered and its paths mounted there.
VIEW_COPIED, VIEW_OWN, VIEW_INTO = 0, 1, 2
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8
_AT_SYMLINK_NOFOLLOW = 0x100
_MS_PRIVATE = 1 << 18
_MOVE_MOUNT_T_EMPTY_PATH = 0x40


def child_arguments(rulesets: Tuple[int, ...], view: Optional[tuple]) -> tuple:
    """What execpool.tool._spawn's child needs to enter the sandbox: the rulesets
    (entered in order, each a Landlock layer), the seccomp filter and the
    view (execpool/sandbox/view.py's ``View.arguments``, or None)."""
    return tuple(rulesets), PROGRAM, view


def _clone_tree(fd: int, path: bytes, read_only: bool) -> int:
    """_spawn.c's clone_tree: a detached, private copy of a tree."""
    if fd >= 0:
        tree = int(syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(fd), b"",
                           ctypes.c_uint(_AT_EMPTY_PATH | _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE)))
    else:
        tree = int(syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(_AT_FDCWD), path,
                           ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE)))
    if tree < 0:
        raise errno_error(f"cloning a path into the view ({os.fsdecode(path)})")
    attr = _MountAttr(_MOUNT_ATTR_RDONLY if read_only else 0, 0, _MS_PRIVATE, 0)
    if syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(tree), b"",
               ctypes.c_uint(_AT_EMPTY_PATH | _AT_RECURSIVE), ctypes.byref(attr),
               ctypes.c_size_t(ctypes.sizeof(attr))) != 0:
        error = errno_error(f"cloning a path into the view ({os.fsdecode(path)})")
        os.close(tree)
        raise error
    return tree


def make_view(view: tuple) -> None:
    """execpool/tool/_spawn.c's make_view, through ctypes."""
    user_fd, mnt_fd, space_fd, job_user_fd, steps, cwd, own_namespace = view
    if own_namespace == VIEW_OWN:  # made ahead for the job (execpool/worker/preparer.py): entered as it is
        if user_fd >= 0 and _libc.setns(user_fd, _CLONE_NEWUSER) != 0 or _libc.setns(mnt_fd, _CLONE_NEWNS) != 0:
            raise errno_error("entering the sandbox's view (setns)")
        os.chdir(cwd)
        _enter_own_user_namespace(job_user_fd)
        return
    clones: list = []
    try:
        in_user = False
        for op, path, text in steps:
            if op not in (STEP_WRITE, STEP_CLONE_RW, STEP_CLONE_RO):
                continue
            if user_fd >= 0 and not in_user:
                if _libc.setns(user_fd, _CLONE_NEWUSER) != 0:
                    raise errno_error("entering the sandbox's view (setns)")
                if _libc.unshare(_CLONE_NEWNS) != 0:
                    raise errno_error("unshare(CLONE_NEWNS)")
                in_user = True
            if op == STEP_WRITE:
                with open(path, "wb") as f:
                    f.write(text)
                continue
            fd = linux.open_unlinked(os.fsdecode(path))
            try:
                clones.append(_clone_tree(fd, path, op == STEP_CLONE_RO))
            finally:
                os.close(fd)
        if user_fd >= 0 and not in_user and _libc.setns(user_fd, _CLONE_NEWUSER) != 0:
            raise errno_error("entering the sandbox's view (setns)")
        if _libc.setns(mnt_fd, _CLONE_NEWNS) != 0:
            raise errno_error("entering the sandbox's view (setns)")
        if own_namespace != VIEW_INTO and _libc.unshare(_CLONE_NEWNS) != 0:
            raise errno_error("unshare(CLONE_NEWNS)")
        for op, a, b in steps:
            _view_step(op, a, b, clones, space_fd)
        os.chdir(cwd)
        _enter_own_user_namespace(job_user_fd)
    finally:
        for fd in clones:
            os.close(fd)


def _enter_own_user_namespace(fd: int) -> None:
    """Last: the job's user namespace (execpool/worker/userns.py), which
    names every process it will have."""
    if fd >= 0 and _libc.setns(fd, _CLONE_NEWUSER) != 0:
        raise errno_error("entering the job's user namespace (setns)")


def _view_step(op: int, a: bytes, b: bytes, clones: list, space_fd: int) -> None:
    if op == STEP_TMPFS:
        failed = _libc.mount(b"tmpfs", a, b"tmpfs", _MS_NOSUID | _MS_NODEV, b) != 0
    elif op == STEP_SPACE:
        tree = int(syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(space_fd), a,
                           ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_SYMLINK_NOFOLLOW)))
        failed = tree < 0
        if not failed:
            clones.append(tree)
    elif op in (STEP_MKDIR, STEP_TOUCH):
        os.makedirs(a if op == STEP_MKDIR else os.path.dirname(a), 0o755, exist_ok=True)
        if op == STEP_TOUCH:
            os.close(os.open(a, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
        failed = False
    elif op == STEP_UNCOVER:
        failed = _libc.umount2(a, _MNT_DETACH | _UMOUNT_NOFOLLOW) != 0
    elif op == STEP_SAVE:
        fd = linux.open_unlinked(os.fsdecode(a))
        try:
            clones.append(_clone_tree(fd, a, False))
        finally:
            os.close(fd)
        failed = False
    elif op == STEP_ATTACH:
        attach(clones[int(a)], os.fsdecode(b))
        failed = False
    else:
        return
    if failed:
        raise errno_error("mounting the job's own paths")


def attach(tree: int, target: str) -> None:
    """Mount a detached tree (:func:`clone_tree`) on ``target``, reached
    without following a link."""
    fd = linux.open_unlinked(target)
    try:
        if syscall(ctypes.c_long(_SYS_MOVE_MOUNT), ctypes.c_int(tree), b"", ctypes.c_int(fd), b"",
                   ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH)) != 0:
            raise errno_error(f"mounting the job's own paths ({target})")
    finally:
        os.close(fd)


def unshare_capless(kinds: int) -> None:
    """For a confined process (a session's copy,
    execpool/tool/session_fork.py): new namespaces, a user namespace
    among them, without the capabilities that namespace gives -- gone in
    this call, before the caller runs another line, since it needs none.
    Its code is its parent session's to change, though, and the parent
    can join that namespace: what the capabilities there could do to the
    host, a file capability, the seccomp filter refuses."""
    if _libc.unshare(kinds) != 0:
        raise errno_error(f"unshare({kinds:#x})")
    _drop_capabilities()


def _drop_capabilities() -> None:
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before 4.3: none to clear
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    if _libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise errno_error("capset")


def _restrict(ruleset_fd: int) -> None:
    if syscall(ctypes.c_long(_SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset_fd), ctypes.c_uint32(0)) != 0:
        raise errno_error("landlock_restrict_self")


def confine_again(ruleset_fd: int) -> None:
    """For a confined process (a session's copy): one more Landlock layer."""
    _restrict(ruleset_fd)


def enter(rulesets: Tuple[int, ...], view: Optional[tuple] = None) -> None:
    """Confine the calling process for good, in the order execpool.tool._spawn
    does it: the job's view (``View.arguments``), no new
    privileges, no capabilities, the Landlock layers, the seccomp filter.
    For a freshly forked tool or a warm spare, before any of the job's code
    runs; raises OSError naming the step that failed."""
    if view is not None:
        make_view(view)
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise errno_error("prctl(PR_SET_NO_NEW_PRIVS)")
    _drop_capabilities()
    for ruleset_fd in rulesets:
        _restrict(ruleset_fd)
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(_fprog), 0, 0) != 0:
        raise errno_error("prctl(PR_SET_SECCOMP)")

"""A sandboxed job's view of the filesystem: a root of its own, as
bubblewrap builds one, that ordinary code does not notice.

Runs in the worker process. The part every job shares -- a tmpfs root that
lists the machine's top-level directories, the system's software bound
read-only, the pool's interpreter and execpool's package at their own
paths, ``/proc``, ``/sys``, a ``/dev`` with the devices programs expect --
is a :class:`Template`, built once per worker in a mount namespace of its
own (in a user namespace of its own where the worker lacks CAP_SYS_ADMIN),
kept by its descriptors. A job's :class:`View` is a few steps its tool's
new process takes (execpool/tool/_spawn.c, or
execpool/shared/kernel/sandbox.py without the extension): enter the
template's namespaces, copy the mount namespace (a few dozen mounts, not
the machine's), and mount what is the job's own -- its ``/tmp`` (and
``/var/tmp``, a link to it), its home and its ``/dev/shm``, directories of
its space (execpool/worker/space.py), its working directory where the
caller gave one, and the paths its ``Sandbox`` adds. Everything else a job may not read is
simply absent: ``/root`` and ``/home`` are empty, other jobs' and the
pool's directories are not there at all, and a Unix socket's path in
``/proc/net/unix`` names, in the job's view, only the job's own files.

A path the caller names (a ``cwd``, a ``Sandbox``
path) is cloned in the worker's mount namespace before the tool enters the
template (``open_tree`` of what ``openat2`` reached without following a
link: a job may have put one there since the worker resolved the path),
made private (a copy sharing the host's propagation would send the job's
mounts back to the host), and attached in the job's copy at its own path:
where the template lacks its directory, on a tmpfs of the job's own
(:class:`_Steps`), so that the template never changes for one job, and no
job sees the names of another's directories.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import stat
import sys
from dataclasses import dataclass, replace
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

from ..shared.kernel.sandbox import VIEW_USER_NS, errno_error, view_kind
from ..shared.package import PACKAGE_DIR
from .enter import (
    STEP_ATTACH,
    STEP_CLONE_RO,
    STEP_CLONE_RW,
    STEP_MKDIR,
    STEP_SAVE,
    STEP_SPACE,
    STEP_TMPFS,
    STEP_TOUCH,
    STEP_UNCOVER,
    VIEW_COPIED,
    VIEW_OWN,
)
from .rulesets import DEVICES, FOLLOWED, SYSTEM_DIRS, python_dirs

#: Where a job finds its own directories in its view.
HOME = "/home/user"
TMP = "/tmp"
SHM = "/dev/shm"
#: A space's directories (execpool/worker/space.py makes them), attached
#: on HOME, TMP and SHM, and their modes: the home is the job's alone,
#: ``/tmp`` and ``/dev/shm`` are as a system's are.
SPACE_HOME, SPACE_TMP, SPACE_SHM = "home", "tmp", "shm"
SPACE_DIRECTORIES = ((SPACE_HOME, 0o700), (SPACE_TMP, 0o1777), (SPACE_SHM, 0o1777))
#: Besides the system's directories and the devices the Landlock rules
#: name (execpool/sandbox/rulesets.py), bound from the host's: the rest of
#: /dev is links into /proc/self/fd and the job's own shm.
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2"}
#: A tmpfs a caller's path is mounted in holds only the directories it needs.
_ANCHOR_OPTIONS = b"mode=0755,size=64k,nr_inodes=256"

_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 1 << 18
_MNT_DETACH = 2
_PR_SET_DUMPABLE = 4
_SYS_PIVOT_ROOT = 155 if os.uname().machine == "x86_64" else 41
_SYS_MOUNT_SETATTR = 442
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _beneath(path: str, ancestor: str) -> bool:
    return path == ancestor or path.startswith(ancestor.rstrip("/") + "/")


def _outermost(paths: Iterable[str]) -> Tuple[str, ...]:
    """``paths`` without those beneath another of them."""
    kept: List[str] = []
    for path in sorted(set(paths), key=len):
        if path != "/" and not any(_beneath(path, other) for other in kept):
            kept.append(path)
    return tuple(sorted(kept))


@dataclass(frozen=True)
class _Plan:
    """What a template holds: the host paths bound read-only (beyond the
    top-level system directories), and what it covers beneath /etc (what
    the world may not read there: a root tool keeps uid 0, and the owner's
    read bit would open it) with the generation of that list."""

    bound: Tuple[str, ...]
    hidden: FrozenSet[str] = frozenset()
    generation: int = 0


class Template:
    """The shared part of every job's view (module docstring), held by
    descriptors: its namespaces, and its root (which the job's Landlock
    layer lets it read: the view shows nothing else)."""

    def __init__(self, user_fd: int, mnt_fd: int, root_fd: int,
                 tops: Tuple[str, ...], bound: Tuple[str, ...], covered: FrozenSet[str]) -> None:
        self.user_fd, self.mnt_fd, self.root_fd = user_fd, mnt_fd, root_fd
        #: The view's top-level directories, and every host path it shows.
        self.tops = tops
        self.bound = bound
        #: What beneath /etc it covers.
        self.covered = covered
        #: The directories of its own making: the top level, home, and those
        #: on the way to what it binds deeper (an interpreter under /root).
        self.dirs = {"/", *tops, *_ancestors(HOME), HOME}
        for path in bound:
            self.dirs.update(parent for parent in _ancestors(path) if not self.shows(parent))
        #: What a job may read in it (``_readable``), as descriptors and
        #: whether each is a directory.
        self.readable = _readable(root_fd, tops, covered)

    def shows(self, path: str) -> bool:
        """Whether ``path`` (a real host path) is in the view as the host has it."""
        return any(_beneath(path, root) for root in self.bound)

    def is_covered(self, path: str) -> bool:
        return any(_beneath(path, covered) for covered in self.covered)

    def deepest_dir(self, path: str) -> str:
        """The deepest directory of the template's own making on the way
        to ``path``."""
        while path not in self.dirs:
            path = os.path.dirname(path)
        return path

    def reaches(self, path: str) -> bool:
        """Whether ``path`` names something in the view, links followed as
        the view has them (``/bin`` to ``/usr/bin``)."""
        return os.path.exists(f"/proc/self/fd/{self.root_fd}{path}")

    def has_dir(self, path: str) -> bool:
        """Whether the view has a directory at ``path`` of its own making."""
        return path in self.dirs

    def descriptors(self) -> List[int]:
        return [fd for fd in (self.user_fd, self.mnt_fd, self.root_fd) if fd >= 0] + [fd for fd, _ in self.readable]

    def close(self) -> None:
        for fd in (self.user_fd, self.mnt_fd, self.root_fd):
            if fd >= 0:
                os.close(fd)
        self.user_fd = self.mnt_fd = self.root_fd = -1
        for fd, _ in self.readable:
            os.close(fd)
        self.readable = []


def _readable(root_fd: int, tops: Iterable[str], covered: FrozenSet[str]) -> List[Tuple[int, bool]]:
    """What a job's Landlock layer lets it read in the view: every top-level
    directory but ``/etc``, and in ``/etc`` every sibling of what the view
    covers and of the covered paths' ancestors -- by inode, never an
    ancestor of a covered path. The covers alone do not hold: replacing a
    covered file by a rename (``passwd`` replacing ``/etc/shadow``) takes
    the mount on its name away in every namespace, and a root job running
    then read the new file; a root-only file made under ``/etc`` while a
    job runs was readable too. Neither inode is granted here."""
    etc_ancestors = {parent for path in covered for parent in _ancestors(path) if _beneath(parent, "/etc")}
    wanted = [top for top in tops if top != "/etc" or not covered]
    for directory in sorted(etc_ancestors):
        for name in os.listdir(f"/proc/self/fd/{root_fd}{directory}"):
            path = f"{directory}/{name}"
            if path not in etc_ancestors and path not in covered:
                wanted.append(path)
    readable = []
    try:
        for path in wanted:
            try:
                fd = os.open(path.lstrip("/"), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
            except OSError:
                continue  # gone since it was listed: nothing to grant
            readable.append((fd, stat.S_ISDIR(os.fstat(fd).st_mode)))
    except BaseException:
        for fd, _ in readable:
            os.close(fd)
        raise
    return readable


@dataclass(frozen=True)
class View:
    """One job's view: what its tool's new process does (the steps, with
    the template's namespaces, as execpool/tool/_spawn.c takes them)."""

    user_fd: int
    mnt_fd: int
    steps: Tuple[Tuple[int, bytes, bytes], ...]
    cwd: str
    #: The job's space, whose directories the steps attach, and its own
    #: user namespace, entered last (execpool/worker/userns.py): the job's
    #: descriptors, not the view's to close; -1 where there are none.
    space_fd: int = -1
    job_user_fd: int = -1
    #: ``mnt_fd`` is the job's own namespace, made ahead with the steps
    #: taken (execpool/worker/preparer.py): the tool enters it as it is.
    own_namespace: bool = False

    def arguments(self) -> tuple:
        return (self.user_fd, self.mnt_fd, self.space_fd, self.job_user_fd, self.steps, os.fsencode(self.cwd),
                VIEW_OWN if self.own_namespace else VIEW_COPIED)

    def close(self) -> None:
        for fd in (self.user_fd, self.mnt_fd):
            if fd >= 0:
                os.close(fd)


class Views:
    """A worker's template, built the first time a sandboxed job needs it
    and again when a job needs a directory it lacks, and the plans of
    jobs' views."""

    def __init__(self, jobs_dir: str) -> None:
        self.jobs_dir = jobs_dir
        self.template: Optional[Template] = None
        self._paths: Dict[Tuple[str, str, Tuple[str, ...]], str] = {}
        self._interpreters: Dict[str, List[str]] = {}
        self._plan = _Plan(_outermost([*python_dirs(sys.executable), PACKAGE_DIR]))

    def current(self, hidden: Optional[Tuple[FrozenSet[str], int]] = None) -> Template:
        """The template, built again where it is stale: ``hidden`` (what to
        cover beneath /etc, and its generation) has changed since it was
        built."""
        plan = self._plan
        if hidden is not None and hidden[1] != plan.generation:
            plan = replace(plan, hidden=hidden[0], generation=hidden[1])
        if self.template is None or plan is not self._plan:
            self._rebuild(plan)
        assert self.template is not None
        return self.template

    def _rebuild(self, plan: _Plan) -> None:
        fresh = _build(self.jobs_dir, plan)
        if self.template is not None:
            self.template.close()
        self.template, self._plan = fresh, plan
        self._paths.clear()

    def plan(self, space_fd: int, job_user_fd: int, cwd: Optional[str], read: Iterable[str], write: Iterable[str],
             python: str, hidden: Tuple[FrozenSet[str], int]) -> View:
        """A job's view. ``space_fd``: its space (execpool/worker/space.py),
        whose home is its working directory unless the caller gave one
        (``cwd``, at its own path), and whose directories are its home,
        ``/tmp`` and ``/dev/shm``; ``job_user_fd``: its own user namespace
        (execpool/worker/userns.py), entered last; ``read`` and ``write``: its sandbox's
        paths; ``python``: its interpreter, whose directories it reads;
        ``hidden``: what to cover beneath /etc (``Confiner.hidden``).
        OSError for a path the sandbox will not give a job."""
        template = self.current(hidden)
        wanted = self._wanted(template, cwd, read, write, python)
        if not _lists_tops(template, wanted):
            self._rebuild(self._plan)  # a top-level directory made since: the view lists it too
            template = self.current()
        return _view(template, wanted, space_fd, job_user_fd, cwd)

    def plan_own(self, template: Template, space_fd: int, python: str) -> Optional[View]:
        """The view of a job with nothing but its own paths (its space, and
        ``python``'s directories), in ``template`` as it is -- what
        execpool/worker/preparer.py makes ahead, without the job's user
        namespace (its tool enters that after the made namespace); None
        where it needs the template built again."""
        wanted = self._wanted(template, None, (), (), python)
        return _view(template, wanted, space_fd, -1, None) if _lists_tops(template, wanted) else None

    def _wanted(self, template: Template, cwd: Optional[str], read: Iterable[str], write: Iterable[str],
                python: str) -> Dict[str, Tuple[int, str]]:
        """Where in the view each path a job names goes, with how (read-only
        or writable) and from which path of the worker's."""
        wanted: Dict[str, Tuple[int, str]] = {}
        for path in self._interpreter_dirs(python):
            if not template.shows(path):
                wanted[path] = (STEP_CLONE_RO, path)
        named = os.path.dirname(os.path.abspath(python))
        if not template.reaches(named):  # its tool is started by this name
            wanted[named] = (STEP_CLONE_RO, os.path.realpath(named))
        for paths, how in ((read, STEP_CLONE_RO), ((*write, *([] if cwd is None else [cwd])), STEP_CLONE_RW)):
            for path in paths:
                real = os.path.abspath(path)
                if os.path.realpath(real) != real:
                    # Where a job could write a directory on the way, it could
                    # have put the link there: what it leads to is not given.
                    raise OSError(f"the sandbox will not follow the link in {path!r}: name the path it leads to, "
                                  f"{os.path.realpath(real)!r}")
                if real == "/" or _beneath(self.jobs_dir, real):
                    raise OSError(f"the sandbox will not give a job {path!r}: it holds the pool's own directories")
                if any(_beneath(covered, real) and covered != real for covered in template.covered):
                    if how == STEP_CLONE_RO and template.shows(real):
                        continue  # in the view already, with what it hides still hidden
                    raise OSError(f"the sandbox will not give a job {path!r}: it holds what only root may read; "
                                  "name what the job needs beneath it")
                if how == STEP_CLONE_RO and template.shows(real) and not template.is_covered(real):
                    continue  # in the view already
                wanted[_seen(real)] = (how, real)
        return wanted

    def _interpreter_dirs(self, python: str) -> List[str]:
        known = self._interpreters.get(python)
        if known is None:
            known = self._interpreters[python] = python_dirs(python)
        return known

    def path(self, python: str, value: str, read: Tuple[str, ...] = ()) -> str:
        """A job's ``PATH``: its interpreter's directory first, so that
        ``python3`` and ``python`` are the pool's Python, then the entries
        of ``value`` the view shows -- the template, or the paths the job's
        sandbox ``read``s (a toolchain's install root) -- but not a pyenv
        shim under a home directory: it is not there, and would be a
        command the shell finds and cannot run."""
        known = self._paths.get((python, value, read))
        if known is None:
            template = self.current()
            kept = [os.path.dirname(os.path.abspath(python))]
            for entry in value.split(os.pathsep):
                if not entry or not os.path.isabs(entry) or entry in kept:
                    continue
                real = os.path.realpath(entry)
                if template.shows(real) or any(_beneath(real, path) for path in read):
                    kept.append(entry)
            known = self._paths[(python, value, read)] = os.pathsep.join(kept)
        return known

    def close(self) -> None:
        if self.template is not None:
            self.template.close()
            self.template = None


def _lists_tops(template: Template, wanted: Dict[str, Tuple[int, str]]) -> bool:
    """Whether the template lists the top-level directory of each path
    that goes in a job's view."""
    return all(_top(target) in template.tops for target in wanted if os.path.lexists(_top(target)))


def _view(template: Template, wanted: Dict[str, Tuple[int, str]], space_fd: int, job_user_fd: int,
          cwd: Optional[str]) -> View:
    steps = _Steps(template, wanted)
    steps.own_paths()
    # Its own copies: the template may be built again before a warm job
    # is handed to its spare.
    user_fd = -1 if template.user_fd < 0 else os.dup(template.user_fd)
    where = HOME if cwd is None else _seen(os.path.abspath(cwd))
    return View(user_fd, os.dup(template.mnt_fd), steps.all(), where, space_fd, job_user_fd)


def _ancestors(path: str) -> List[str]:
    found = []
    while path != "/":
        path = os.path.dirname(path)
        found.append(path)
    return found


def _top(path: str) -> str:
    return "/" + path.split("/")[1]


def _seen(path: str) -> str:
    """Where a path of the worker's is in a job's view: at its own path,
    but beneath /var/tmp -- the job's /tmp, as /var/tmp links to it."""
    if _beneath(path, "/var/tmp"):
        return TMP + path[len("/var/tmp"):]
    return path


class _Steps:
    """A job's view as the steps its tool's process takes: clones of the
    worker's paths first (they must be made in the worker's namespace),
    then, in the job's copy of the template, tmpfs *anchors* for paths whose
    directory the template lacks, the job's own home, /tmp and /dev/shm, and
    the paths that go in those.

    An anchor is a tmpfs of the job's own on the deepest directory the
    template has on the path's way (``/srv``, ``/root``): the directories
    beneath it are made there, so no job ever sees another's names; what
    the template had beneath it (an interpreter's prefix under ``/root``)
    is cloned first and attached again."""

    def __init__(self, template: Template, wanted: Dict[str, Tuple[int, str]]) -> None:
        self.template = template
        self.clones: List[Tuple[int, bytes, bytes]] = []
        self.anchored: List[Tuple[int, bytes, bytes]] = []
        self.own: List[Tuple[int, bytes, bytes]] = []
        self.inside: List[Tuple[int, bytes, bytes]] = []
        # Clones made in the job's namespace (saves, the space's
        # directories), numbered after the worker's in the order taken.
        self._later = 0
        self._anchors: List[str] = []
        self._placed: Dict[str, List[Tuple[int, bytes, bytes]]] = {}
        for target in sorted(wanted):
            how, source = wanted[target]
            self.clones.append((how, os.fsencode(source), b""))
        for index, target in enumerate(sorted(wanted)):
            self._place(target, index, os.path.isdir(wanted[target][1]), set(wanted))

    def all(self) -> Tuple[Tuple[int, bytes, bytes], ...]:
        return (*self.clones, *self.anchored, *self.own, *self.inside)

    def _place(self, target: str, index: int, is_dir: bool, targets: set) -> None:
        template = self.template
        attach = (STEP_ATTACH, str(index).encode(), os.fsencode(target))
        make = (STEP_MKDIR if is_dir else STEP_TOUCH, os.fsencode(target), b"")
        parent = next((done for done in sorted(self._placed, key=len, reverse=True) if _beneath(target, done)), None)
        if parent is not None:  # in what is attached there already: the path is in its content
            group, steps = self._placed[parent], [attach]
        elif target in template.covered:  # named, so given: the cover goes first
            group, steps = self.inside, [(STEP_UNCOVER, os.fsencode(target), b""), attach]
        elif (template.shows(target) or template.has_dir(target)) and not template.is_covered(target):
            group, steps = self.inside, [attach]
        elif _beneath(target, TMP) or _beneath(target, HOME):
            group, steps = self.inside, [make, attach]
        else:
            # On a tmpfs over the covered directory it is in (its other
            # files stay hidden), or over the template's deepest on its way.
            anchor = next((path for path in template.covered if _beneath(target, path)), None)
            anchor = anchor or template.deepest_dir(target)
            if not any(_beneath(anchor, done) for done in self._anchors):
                self._anchor(anchor, targets)
            group, steps = self.anchored, [make, attach]
        group += steps
        self._placed[target] = group

    def own_paths(self) -> None:
        """The job's home, /tmp and /dev/shm: directories of its space,
        cloned in its namespace and attached in their places; what the
        template binds beneath /tmp (an interpreter in a checkout there)
        goes into the job's /tmp again."""
        self._attach_space(self.own, SPACE_HOME, HOME)
        self._reattached(TMP, self.own, lambda: self._attach_space(self.own, SPACE_TMP, TMP))
        self._attach_space(self.own, SPACE_SHM, SHM)

    def _clone_later(self, into: list, op: int, path: bytes) -> bytes:
        """A clone taken in the job's namespace, put on ``into``: the number
        its attach names."""
        into.append((op, path, b""))
        number = len(self.clones) + self._later
        self._later += 1
        return str(number).encode()

    def _attach_space(self, into: list, name: str, target: str) -> None:
        into.append((STEP_ATTACH, self._clone_later(into, STEP_SPACE, name.encode()), target.encode()))

    def _reattached(self, where: str, into: list, mount: Callable[[], None], skip: Iterable[str] = ()) -> None:
        """``mount`` on ``where``, with what the template binds beneath it
        cloned before and attached again after (but what beneath ``skip``
        the job's own paths bring): steps put on ``into``."""
        kept = [path for path in self.template.bound if _beneath(path, where) and path != where
                and not any(_beneath(path, other) for other in skip)]
        saved = [self._clone_later(into, STEP_SAVE, os.fsencode(path)) for path in kept]
        mount()
        for number, path in zip(saved, kept, strict=True):
            into += [(STEP_MKDIR, os.fsencode(path), b""), (STEP_ATTACH, number, os.fsencode(path))]

    def _anchor(self, anchor: str, targets: set) -> None:
        """A tmpfs on ``anchor``, and what the template had beneath it
        again -- what the job's own paths do not bring themselves."""
        self._anchors.append(anchor)
        if anchor in self.template.covered:  # a cover is a deleted directory, which takes no mount
            self.anchored.append((STEP_UNCOVER, os.fsencode(anchor), b""))
        self._reattached(anchor, self.anchored,
                         lambda: self.anchored.append((STEP_TMPFS, os.fsencode(anchor), _ANCHOR_OPTIONS)),
                         skip=targets)
        if _beneath(HOME, anchor) and HOME != anchor:
            self.anchored.append((STEP_MKDIR, HOME.encode(), b""))


def _build(jobs_dir: str, plan: _Plan) -> Template:
    """Build a template in a child of the worker (the worker itself never
    changes namespaces) and take its descriptors; OSError naming the step
    that failed."""
    stage = os.path.join(jobs_dir, ".view")
    os.makedirs(stage, 0o700, exist_ok=True)
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    kind = view_kind()
    uid, gid = os.geteuid(), os.getegid()
    pid = os.fork()
    if pid == 0:
        parent_sock.close()
        try:
            fds, shape = _make(stage, plan, kind, uid, gid)
            socket.send_fds(child_sock, [json.dumps(shape).encode()], fds)
            os._exit(0)
        except BaseException as exc:  # noqa: BLE001 - reported to the worker, never back into its loop
            try:
                child_sock.sendall(f"error: {exc}".encode("utf-8", "replace")[:2048])
            finally:
                os._exit(1)
    child_sock.close()
    try:
        message, fds, _flags, _addr = socket.recv_fds(parent_sock, 1 << 16, 3)
    finally:
        parent_sock.close()
        os.waitpid(pid, 0)
    if message.startswith(b"error: ") or not fds:
        for fd in fds:
            os.close(fd)
        raise OSError(f"the sandbox's view could not be built: {message[7:].decode('utf-8', 'replace') or 'no answer'}")
    tops, bound, covered = json.loads(message)
    if kind != VIEW_USER_NS:
        fds.insert(0, -1)
    user_fd, mnt_fd, root_fd = fds
    return Template(user_fd, mnt_fd, root_fd, tuple(tops), tuple(bound), frozenset(covered))


def _check(result: int, what: str) -> None:
    if result != 0:
        raise errno_error(what)


def _mount(source: Optional[str], target: str, fstype: Optional[str], flags: int, data: Optional[str] = None) -> None:
    _check(_libc.mount(None if source is None else os.fsencode(source), os.fsencode(target),
                       None if fstype is None else fstype.encode(), ctypes.c_ulong(flags),
                       None if data is None else data.encode()), f"mount {target}")


def _read_only(path: str, recursive: bool) -> None:
    attr = _MountAttr(1, 0, 0, 0)
    _check(_libc.syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), os.fsencode(path),
                         ctypes.c_uint(_AT_RECURSIVE if recursive else 0), ctypes.byref(attr),
                         ctypes.c_size_t(ctypes.sizeof(attr))), f"read-only {path}")


def _bind(source: str, root: str, target: str, recursive: bool = True) -> None:
    """``source`` at ``target`` in the view being built at ``root``."""
    where = root + target
    if os.path.isdir(source):
        os.makedirs(where, 0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(where), 0o755, exist_ok=True)
        if not os.path.exists(where):
            os.close(os.open(where, os.O_CREAT | os.O_WRONLY, 0o644))
    _mount(source, where, None, _MS_BIND | (_MS_REC if recursive else 0))


def _cover(stage: str, hidden: Iterable[str]) -> List[str]:
    """An empty directory, or a file no one may open, over each of
    ``hidden``: in the view a hidden directory is there and holds nothing
    (a walk of /etc goes on), and a hidden file refuses to open, as it does
    to any user who is not root. The covers' own names are removed, so that
    nothing but the covered paths shows them."""
    empty_dir, empty_file = stage + "/.cover-dir", stage + "/.cover-file"
    os.mkdir(empty_dir, 0o700)
    os.close(os.open(empty_file, os.O_CREAT | os.O_WRONLY, 0))
    os.chmod(empty_file, 0)
    covered = []
    for path in sorted(hidden):
        where = stage + path
        if not _beneath(path, "/etc") or os.path.islink(where) or not os.path.lexists(where):
            continue
        _mount(empty_dir if os.path.isdir(where) else empty_file, where, None, _MS_BIND)
        covered.append(path)
    os.rmdir(empty_dir)
    os.unlink(empty_file)
    return covered


def _make(stage: str, plan: _Plan, kind: int, uid: int, gid: int) -> Tuple[list, list]:
    """In the builder child: the template; the descriptors the worker
    keeps (user namespace where there is one, mount namespace, root); and
    its shape (its top-level directories, the host paths it shows, what it
    covers)."""
    fds = []
    if kind == VIEW_USER_NS:
        # A non-dumpable worker's child owns none of its /proc files, so it
        # could not write its maps; it lives only until the template is built.
        _check(_libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
        _check(_libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare(CLONE_NEWUSER)")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        fds.append(os.open("/proc/self/ns/user", os.O_RDONLY | os.O_CLOEXEC))
    else:
        _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    fds.append(os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount("tmpfs", stage, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
    tops, bound = [], []
    entries = {entry.name: entry for entry in os.scandir("/")}
    for name in sorted({*entries, "tmp", "home", "dev", "proc", "sys", "var"}):
        entry = entries.get(name)
        where = os.path.join(stage, name)
        if entry is not None and entry.is_symlink():
            os.symlink(os.readlink(entry.path), where)
            continue
        if entry is not None and not entry.is_dir(follow_symlinks=False):
            continue  # a file at the top: not in the view
        os.mkdir(where, 0o755)
        tops.append("/" + name)
    os.makedirs(stage + HOME, 0o755)
    fds.append(os.open(stage, os.O_PATH | os.O_CLOEXEC))
    for path in SYSTEM_DIRS:
        if path in tops:
            _bind(path, stage, path)
            bound.append(os.path.realpath(path))
    for path in FOLLOWED:  # their targets too, or name resolution would fail
        target = os.path.realpath(path)
        if os.path.exists(target) and not any(_beneath(target, done) for done in bound):
            _bind(target, stage, target, recursive=False)
            bound.append(target)
    for path in plan.bound:
        if os.path.exists(path) and not any(_beneath(path, done) for done in bound):
            _bind(path, stage, path)
            bound.append(path)
    _bind("/sys", stage, "/sys")
    bound.append("/sys")
    if kind == VIEW_USER_NS:
        _bind("/proc", stage, "/proc")  # a user namespace may not mount a procfs of the machine's pid namespace
    else:
        # Its own procfs: a process the job may not trace (outside its
        # Landlock domain) is not listed at all.
        _mount("proc", stage + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=ptraceable")
    bound.append("/proc")
    _mount("tmpfs", stage + "/dev", "tmpfs", _MS_NOSUID | _MS_NOEXEC, "mode=0755,size=64k")
    for path in DEVICES:
        if os.path.exists(path):
            _bind(path, stage, path, recursive=False)
    for name, target in _DEV_LINKS.items():
        os.symlink(target, f"{stage}/dev/{name}")
    os.mkdir(stage + SHM, 0o755)
    os.symlink(TMP, stage + "/var/tmp")
    covered = _cover(stage, plan.hidden)
    _read_only(stage, recursive=True)
    os.chdir(stage)
    _check(_libc.syscall(ctypes.c_long(_SYS_PIVOT_ROOT), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "detaching the old root")
    os.chdir("/")
    return fds, [tops, bound, covered]

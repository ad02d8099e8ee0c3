"""A worker's Landlock rulesets for its sandboxed jobs: what each job may
touch, built before its tool starts.

Worker side. execpool/shared/kernel/sandbox.py holds what a caller asks for
(:class:`~execpool.sandbox.Sandbox`) and how a tool's new process enters
the rulesets built here. Every sandboxed job gets two Landlock layers, and
an access must pass both:

1. **The world-readable layer** handles reading files only, and allows it
   everywhere but where the world may not read beneath ``/etc``
   (``/etc/shadow``, ``/etc/ssl/private``, host keys): a root tool keeps
   uid 0 with no capability, and the owner's read bit alone would
   otherwise open those to it. Landlock grants, never denies, so the layer
   grants every sibling of what it hides and of each of their ancestors
   (170 or so rules here), built once per worker and built again for the
   next job whenever inotify reports a change beneath ``/etc`` (or in
   ``/``): a file made, replaced by a rename (a new inode the old rule
   does not cover) or made root-only.
2. **The job's layer** handles every right: read and execute on the
   system's software, ``/proc`` and ``/sys``, a few devices, ``/dev/shm``
   by name, every right on the job's directory and its private
   ``TMPDIR`` and what the caller's ``Sandbox`` adds -- and it scopes
   signals and abstract Unix sockets to the job. A dozen rules, built per
   job (about 20 µs in C).

A path the caller names that the first layer does not cover -- one made
since it was built, or one it hides, which naming it gives the job -- gets
a first layer of the job's own.

A job with a view (execpool/sandbox/view.py) enters the second layer alone:
its view hides what the first would (Landlock checks no rule on a
mountpoint, so the first could not grant the view's own directories), and
the second lets it read what its view shows.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import sys
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Protocol, Sequence, Set, Tuple, Union

from ..shared.kernel.linux import open_unlinked
from ..shared.kernel.sandbox import (
    MIN_LANDLOCK_ABI,
    SYS_LANDLOCK_CREATE_RULESET,
    SYSTEM_DIRS,
    Sandbox,
    errno_error,
    landlock_abi,
    prepare,
    sandbox_support,
    syscall,
    too_wide,
)
from ..shared.package import PACKAGE_DIR

logger = logging.getLogger("execpool")


class Shown(Protocol):
    """What the rules need of a view's template (execpool/sandbox/view.py's
    ``Template``): its root and what it lets a job read, as descriptors."""

    root_fd: int
    readable: List[Tuple[int, bool]]

# -- Landlock's ABI (include/uapi/linux/landlock.h) ------------------------------------------------

_SYS_LANDLOCK_ADD_RULE = 445
_RULE_PATH_BENEATH = 1
_RULE_NET_PORT = 2

NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1  # ABI 4

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_FILE = 1 << 5
FS_MAKE_REG = 1 << 8
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5

#: Every filesystem right each ABI knows: a ruleset handles all of them, so
#: what no rule grants is denied -- renaming and linking across directories
#: (REFER) and truncating (TRUNCATE) included, where the kernel knows them.
_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1}
_FS_RIGHTS_LATEST = (1 << 16) - 1

#: The rights that apply to a file (the rest are about directories); a rule
#: on a file may grant only these.
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV

SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6


READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
#: A device the tool may read and write, and open with O_TRUNC (``> /dev/null``).
_DEVICE = FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE
#: ``/dev/shm``: files made, used and removed by name -- POSIX semaphores,
#: so multiprocessing works -- but not listed: other processes' segments
#: there have random names the tool cannot see.
_SHM = FS_MAKE_REG | FS_READ_FILE | FS_WRITE_FILE | FS_REMOVE_FILE | FS_TRUNCATE

#: Read-only views a tool's programs expect: itself and the machine.
READ_ONLY_DIRS = ("/proc", "/sys")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
SHARED_MEMORY = "/dev/shm"
#: /etc files that are often symlinks out of /etc (systemd's resolver):
#: their targets are granted too, or name resolution would fail.
FOLLOWED = ("/etc/resolv.conf",)


#: Beneath these, what the world may not read stays unreadable to a root
#: tool (the world-readable layer).
GUARDED_TREES = ("/etc",)

# inotify (sys/inotify.h): what in a watched directory makes the layer stale.
_IN_ATTRIB, _IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x4, 0x40, 0x80, 0x100, 0x200
_IN_DELETE_SELF, _IN_MOVE_SELF, _IN_ONLYDIR, _IN_DONT_FOLLOW = 0x400, 0x800, 0x01000000, 0x02000000
_WATCHED = (_IN_ATTRIB | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE | _IN_DELETE_SELF | _IN_MOVE_SELF
            | _IN_ONLYDIR | _IN_DONT_FOLLOW)
_libc = ctypes.CDLL(None, use_errno=True)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is packed: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]



def python_dirs(python: str) -> List[str]:
    """Where a Python interpreter's standard library and packages live: the
    prefix of what ``python`` resolves to (one holding ``lib/python3*``),
    and the venv it is named through (one holding ``pyvenv.cfg``: a venv's
    python is a link to its base interpreter). Never a prefix read off an
    unresolved path -- ``/bin/python3`` on a merged-/usr system would make
    it ``/``, whose ``lib`` is ``/usr/lib`` -- and never one that holds
    home directories (``too_wide``): OSError then."""
    real = os.path.realpath(python)
    prefix = os.path.dirname(os.path.dirname(real))
    lib = os.path.join(prefix, "lib")
    dirs = []
    if os.path.isdir(lib) and any(name.startswith("python3") for name in os.listdir(lib)):
        dirs.append(prefix)
    venv = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(python))))
    if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        dirs.append(venv)
    for path in dirs:
        if too_wide(path):
            raise OSError(f"the sandbox will not open {path!r} to the interpreter {python!r}: it holds home "
                          "directories; name an interpreter installed in a prefix of its own")
    return dirs


#: ``build(handled_fs, scoped, [(fd, rights), ...], handled_net, [(port,
#: rights), ...]) -> ruleset fd``.
RulesetBuilder = Callable[[int, int, List[Tuple[int, int]], int, List[Tuple[int, int]]], int]


class _NetPort(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def build_ruleset(handled: int, scoped: int, rules: List[Tuple[int, int]], handled_net: int = 0,
                  ports: Sequence[Tuple[int, int]] = ()) -> int:
    """A ruleset through ctypes, one call per rule: what a worker without
    the C extension uses (execpool.tool._spawn.ruleset does the same in one)."""
    attr = _RulesetAttr(handled, handled_net, scoped)
    ruleset = int(syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(attr),
                           ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0)))
    if ruleset < 0:
        raise errno_error("landlock_create_ruleset")
    try:
        add_rules(ruleset, rules)
        for port, rights in ports:
            net = _NetPort(rights, port)
            if syscall(ctypes.c_long(_SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(_RULE_NET_PORT),
                        ctypes.byref(net), ctypes.c_uint32(0)) != 0:
                raise errno_error("landlock_add_rule")
    except BaseException:
        os.close(ruleset)
        raise
    return ruleset


def add_rules(ruleset: int, rules: Iterable[Tuple[int, int]]) -> None:
    """Grant each (descriptor, rights) in a ruleset not yet entered."""
    rule = _PathBeneath()
    for fd, rights in rules:
        rule.allowed_access, rule.parent_fd = rights, fd
        if syscall(ctypes.c_long(_SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset),
                    ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise errno_error("landlock_add_rule")


def _beneath(path: str, ancestor: str) -> bool:
    return path != ancestor and path.startswith(ancestor.rstrip("/") + "/")


def _unreadable(top: str) -> Tuple[Set[str], List[str]]:
    """What beneath ``top`` the world may not read -- files without the
    others' read bit, and directories without their read or search bit,
    which are not looked into -- and the directories that were: ``top``
    and those beneath it. Symbolic links are left alone: the kernel checks
    what a link resolves to."""
    hidden: Set[str] = set()
    pending, looked = [top], []
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        looked.append(directory)
        for entry in entries:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode):
                if mode & (stat.S_IROTH | stat.S_IXOTH) != stat.S_IROTH | stat.S_IXOTH:
                    hidden.add(entry.path)
                else:
                    pending.append(entry.path)
            elif not stat.S_ISLNK(mode) and not mode & stat.S_IROTH:
                hidden.add(entry.path)
    return hidden, looked


class _Changes:
    """An inotify instance watching the directories the layer was built
    from: a file made, moved, removed, or its mode or owner changed, in
    any of them. Read (without blocking) before each job, so that no job
    starts with a layer older than a change the kernel has already
    reported -- a key written 0600 under /etc/letsencrypt, a file chmod'ed
    to 0600. Where inotify cannot watch them all (out of instances or
    watches), every job finds the layer stale: slower, never wrong."""

    def __init__(self, directories: Iterable[str]) -> None:
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            return
        for directory in directories:
            if _libc.inotify_add_watch(self.fd, os.fsencode(directory), _WATCHED) < 0:
                self.close()
                return

    @property
    def watching(self) -> bool:
        return self.fd >= 0

    def seen(self) -> bool:
        """Whether anything changed since the last call (always, unwatched)."""
        if self.fd < 0:
            return True
        changed = False
        while True:
            try:
                changed = bool(os.read(self.fd, 65536)) or changed
            except BlockingIOError:
                return changed

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _WorldReadable:
    """The first layer (module docstring): reading files everywhere but
    what :func:`_unreadable` finds beneath :data:`GUARDED_TREES`."""

    def __init__(self, build: RulesetBuilder) -> None:
        self.build = build
        self.fd = -1
        self.changes: Optional[_Changes] = None
        self.unwatched_said = False
        self.hidden: FrozenSet[str] = frozenset()
        self.ancestors: Set[str] = set()
        self.granted: Set[str] = set()
        self.generation = 0

    def close(self) -> None:
        self._drop_layer()
        if self.changes is not None:
            self.changes.close()
            self.changes = None

    def _drop_layer(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def current(self) -> Tuple[FrozenSet[str], int]:
        """What the world may not read beneath /etc now, and a number that
        changes whenever that is read again: a job's view covers each
        (execpool/sandbox/view.py) instead of entering this layer."""
        if self.changes is None or self.changes.seen():
            self._scan()
        return self.hidden, self.generation

    def layer(self, paths: Iterable[str]) -> Optional[int]:
        """A descriptor of the layer for a job that names ``paths``, the
        caller's to close; None where nothing is hidden. A job keeps the
        layer it started with: what changes while it runs is hidden from
        the jobs that start after."""
        self.current()
        if not self.hidden:
            return None
        if self.fd < 0:
            self.fd = self._ruleset(self.granted)
        extra = [path for path in paths if self._uncovered(os.path.realpath(path))]
        if not extra:
            return os.dup(self.fd)
        return self._ruleset([*self.granted, *extra])

    def _scan(self) -> None:
        self.close()
        self.generation += 1
        hidden, looked = set(), ["/"]  # "/": a directory made there is new to the layer
        for top in GUARDED_TREES:
            if os.path.isdir(top):
                found, directories = _unreadable(os.path.realpath(top))
                hidden |= found
                looked += directories
        self.hidden = frozenset(hidden)
        # Watched before the layer is read off the disk: a change from here
        # on makes the next job build it again.
        self.changes = _Changes(looked)
        if not self.changes.watching and not self.unwatched_said:
            self.unwatched_said = True
            logger.warning("execpool: inotify cannot watch %s here; every sandboxed job builds its layers anew",
                           " ".join(GUARDED_TREES))
        self.ancestors, self.granted = set(), set()
        for path in self.hidden:
            parent = os.path.dirname(path)
            while parent not in self.ancestors:
                self.ancestors.add(parent)
                if parent == "/":
                    break
                parent = os.path.dirname(parent)
        for directory in self.ancestors:
            try:
                names = os.listdir(directory)
            except OSError:  # gone since it was read: its watch makes the next job look again
                continue
            for name in names:
                path = os.path.join(directory, name)
                if path not in self.ancestors and path not in self.hidden and not os.path.islink(path):
                    self.granted.add(path)

    def _uncovered(self, path: str) -> bool:
        """Whether the layer must grant ``path`` for the job to read it: it
        is hidden (naming it gives it), or new in a directory the layer
        lists. A directory that holds hidden files itself needs nothing:
        the job reads what in it the world may."""
        if path in self.ancestors:
            return False
        while path not in self.granted:
            if path in self.hidden or path in self.ancestors:
                return True
            path = os.path.dirname(path)
        return False

    def _ruleset(self, paths: Iterable[str]) -> int:
        rules, opened = [], []
        try:
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # gone since: nothing to grant (a caller's path fails in the job's layer)
                opened.append(fd)
                rules.append((fd, FS_READ_FILE))
            return self.build(FS_READ_FILE, 0, rules, 0, [])
        finally:
            for fd in opened:
                os.close(fd)


class Confiner:
    """A worker's maker of rulesets: the layers of each sandboxed job,
    built before the tool starts and entered by the tool's process.

    The system paths are opened once (``O_PATH``) and kept; each job costs
    one ruleset with a rule per path (a dozen or so), opening its own
    paths, and a copy of the world-readable layer's descriptor. Building
    them here rather than in the tool's process keeps the vfork child to a
    few system calls and lets a warm spare receive its rulesets ready-made.
    ``build`` is execpool.tool._spawn.ruleset where the extension was
    built (one call for every rule), :func:`build_ruleset` otherwise.
    Raises OSError with a clear message where the kernel lacks what the
    sandbox needs."""

    def __init__(self, build: Optional[RulesetBuilder] = None) -> None:
        support = self.support = sandbox_support()
        missing = support.missing_for(Sandbox(read_only_view=False))
        if missing is not None:
            raise OSError(missing)
        self.build = build or build_ruleset
        self.handled = _FS_RIGHTS_BY_ABI.get(support.landlock_abi, _FS_RIGHTS_LATEST)
        self.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
        grants: Dict[str, int] = {}
        for path in SYSTEM_DIRS:
            self._grant(grants, path, READ)
        for python in {sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
            for path in ([os.path.realpath(python)] if os.path.isdir(python) else python_dirs(python)):
                if not too_wide(path):  # the job's interpreter gets its own rules, or a clear error
                    self._grant(grants, path, READ)
        # execpool's own code: the tool layer's /mnt/data shim, and what a
        # warm job's interpreter already runs.
        self._grant(grants, PACKAGE_DIR, READ)
        for path in READ_ONLY_DIRS:
            self._grant(grants, path, READ)
        for path in DEVICES:
            self._grant(grants, path, _DEVICE)
        self._grant(grants, SHARED_MEMORY, _SHM)
        for path in FOLLOWED:
            self._grant(grants, os.path.realpath(path), FS_READ_FILE)
        self.granted = _pruned(grants)
        self._base: List[Tuple[int, int]] = []
        #: The same but what lies beneath /etc, for a job with a view: its
        #: template grants that, less what it hides (``Template.readable``).
        self._base_beside_view: List[Tuple[int, int]] = []
        for path, rights in self.granted.items():
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone since: nothing to grant
            self._base.append((fd, self._rights(fd, rights)))
            if not any(path == tree or _beneath(path, tree) for tree in GUARDED_TREES):
                self._base_beside_view.append(self._base[-1])
        self._interpreters: Dict[str, List[Tuple[int, int]]] = {}
        self._guard = _WorldReadable(self.build)
        prepare()

    @staticmethod
    def _grant(grants: Dict[str, int], path: str, rights: int) -> None:
        if os.path.exists(path):
            real = os.path.realpath(path)
            grants[real] = grants.get(real, 0) | rights

    def _rights(self, fd: int, rights: int) -> int:
        rights &= self.handled
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= _FILE_RIGHTS
        return rights

    def rulesets(self, python: str, sandbox: Sandbox, own: Sequence[Union[str, int]],
                 template: Optional[Shown] = None) -> Tuple[int, ...]:
        """One job's layers, in the order the tool enters them, as
        descriptors the caller closes once the tool did: the world-readable
        layer, and the job's own -- the system paths, ``python``'s prefix,
        the job's ``own`` directories (paths, or descriptors the caller
        opened: its space's directories) and the sandbox's ``write`` (every
        right), its ``read`` (read and execute), the TCP ports it may
        connect to and bind, and, for a job with a view (``template``),
        reading what the view shows: it shows nothing else, and hides what
        the first layer would (Landlock checks no rule on a mountpoint, so
        that layer could not grant the view's own directories anyway)."""
        paths = [path for path in own if isinstance(path, str)]
        guard = None if template is not None else self._guard.layer((*paths, *sandbox.read, *sandbox.write))
        try:
            view_root = () if template is None else self._view_rules(template)
            return (*(() if guard is None else (guard,)), self._job_ruleset(python, sandbox, own, view_root))
        except BaseException:
            if guard is not None:
                os.close(guard)
            raise

    def _job_ruleset(self, python: str, sandbox: Sandbox, own: Sequence[Union[str, int]],
                     view_root: Tuple[Tuple[int, int], ...]) -> int:
        read = sandbox.read
        write = (*(path for path in own if isinstance(path, str)), *sandbox.write)
        handled_net = 0
        ports: Dict[int, int] = {}
        for allowed, right in ((sandbox.connect, NET_CONNECT_TCP), (sandbox.bind, NET_BIND_TCP)):
            if allowed is not None:
                handled_net |= right
                for port in allowed:
                    ports[port] = ports.get(port, 0) | right
        opened: List[int] = []
        try:
            rules = [*(self._base_beside_view if view_root else self._base), *self._interpreter(python), *view_root,
                     *((fd, self._rights(fd, self.handled)) for fd in own if isinstance(fd, int))]
            wanted = dict.fromkeys(write, self.handled)
            for path in read:
                wanted[path] = wanted.get(path, 0) | READ
            for path, rights in wanted.items():
                try:
                    # What the tool's process clones is reached the same way
                    # (execpool/sandbox/view.py): without following a link.
                    fd = open_unlinked(os.path.abspath(path))
                except OSError as exc:
                    raise OSError(exc.errno, f"the sandbox cannot open {path!r}: {exc.strerror}") from None
                opened.append(fd)
                rules.append((fd, self._rights(fd, rights)))
            return self.build(self.handled, self.scoped, [rule for rule in rules if rule[1]], handled_net,
                              sorted(ports.items()))
        finally:
            for fd in opened:
                os.close(fd)

    def _view_rules(self, template: Shown) -> Tuple[Tuple[int, int], ...]:
        """Listing every directory of the view, reading what the template
        lets a job read (``Template.readable``): the view shows nothing
        else, and these grants hide what the template's covers hide, by
        inode, so that nothing that changes beneath /etc while the job runs
        becomes readable."""
        rights = self.handled & READ
        return ((template.root_fd, rights & FS_READ_DIR),
                *((fd, rights if is_dir else rights & _FILE_RIGHTS) for fd, is_dir in template.readable))

    def _interpreter(self, python: str) -> List[Tuple[int, int]]:
        """The rules granting a job's interpreter (a pool may name one the
        worker itself does not run), opened once per interpreter."""
        known = self._interpreters.get(python)
        if known is None:
            known = []
            for path in {os.path.realpath(p) for p in [python, *python_dirs(python)]}:
                if any(path == done or _beneath(path, done) for done in self.granted) or not os.path.exists(path):
                    continue
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                known.append((fd, self._rights(fd, READ)))
            self._interpreters[python] = known
        return list(known)

    def descriptors(self) -> List[int]:
        """What it keeps open to build a job's layer with a view."""
        return [fd for fd, _ in self._base] + [fd for known in self._interpreters.values() for fd, _ in known]

    def hidden(self) -> Tuple[FrozenSet[str], int]:
        """What a job's view hides beneath /etc, and its generation
        (``_WorldReadable.current``)."""
        return self._guard.current()

    def close(self) -> None:
        for fd, _ in self._base:
            os.close(fd)
        self._base_beside_view.clear()
        for known in self._interpreters.values():
            for fd, _ in known:
                os.close(fd)
        self._base.clear()
        self._interpreters.clear()
        self._guard.close()


def apart_grants(hidden: Sequence[str]) -> List[Tuple[int, int]]:
    """What each of several samples judged side by side in one job
    (execpool/tool/judge.py) may read, opened once for all of them, as
    (descriptor, rights) for :func:`apart_ruleset`: the interpreter's
    prefix, execpool's code and every entry of ``/`` but those holding a
    ``hidden`` path (the job's writable places, where the samples'
    directories are), read and execute; the devices. OSError where the
    kernel cannot scope signals (Landlock ABI below 6): the samples cannot
    be kept apart."""
    abi = landlock_abi()
    if abi < MIN_LANDLOCK_ABI:
        raise OSError(f"samples judged in one job are kept apart by Landlock ABI {MIN_LANDLOCK_ABI}, and this "
                      f"kernel offers {abi}")
    handled = _FS_RIGHTS_BY_ABI.get(abi, _FS_RIGHTS_LATEST)
    covered = [os.path.realpath(path) for path in hidden]
    grants: Dict[str, int] = {}
    for path in (os.path.join("/", name) for name in os.listdir("/")):
        if not any(place == path or _beneath(place, path) for place in covered):
            grants[path] = READ
    for path in {*python_dirs(sys.executable), PACKAGE_DIR}:
        grants[path] = READ
    for path in DEVICES:
        grants[path] = _DEVICE
    rules: List[Tuple[int, int]] = []
    for path, rights in grants.items():
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a dangling link at the root, a device this machine lacks
        mask = handled if stat.S_ISDIR(os.fstat(fd).st_mode) else handled & _FILE_RIGHTS
        rules.append((fd, rights & mask))
    return rules


def apart_ruleset(grants: Sequence[Tuple[int, int]], own: str) -> int:
    """The layer one of those samples and its judge enter before the
    sample runs: ``grants`` (:func:`apart_grants`), every right on ``own``
    (its directory), signals and abstract Unix sockets scoped to it, and
    no TCP bind or connect: batch-mates share the job's network, and one
    that served sums on loopback passed another that asked it. UDP stays
    open to them (Landlock has no rule for it)."""
    abi = landlock_abi()
    handled = _FS_RIGHTS_BY_ABI.get(abi, _FS_RIGHTS_LATEST)
    fd = os.open(own, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return build_ruleset(handled, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL,
                             [rule for rule in (*grants, (fd, handled)) if rule[1]],
                             NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0)
    finally:
        os.close(fd)


def _pruned(grants: Dict[str, int]) -> Dict[str, int]:
    """The grants without those an ancestor's already give: fewer rules for
    every job (``/bin`` is ``/usr/bin`` on a merged-/usr system)."""
    return {path: rights for path, rights in grants.items()
            if not any(_beneath(path, other) and rights & ~grants[other] == 0 for other in grants)}

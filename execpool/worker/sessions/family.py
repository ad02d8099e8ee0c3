"""A sandboxed Python session's forks: the directories its copies will
write, ruled in before the session starts, and the mounts that give a copy
its own.

Runs in the worker process (``Family``, ``copy_layer``) and in a short-lived
fork of it (``mount_copy``'s helper). Why it takes all this: a copy is a
fork of a confined process, so it keeps its parent's Landlock domain, which
no process can leave or widen, and its mount namespace, where ``/tmp``, the
home and ``/dev/shm`` are its parent's. A confined process may not mount.
So:

- **Spares, ruled in at the start.** A session that may fork starts with
  FAMILY_FORKS spare spaces (execpool/worker/space.py: each a tmpfs of the
  session's disk bound, with a ``home``, ``tmp``, ``shm`` and ``work``),
  every right on their directories in its own ruleset: the only new
  directories a copy can ever write are ones its first ancestor's domain
  already granted. No process of the family can reach them until the
  worker mounts one into a copy's namespace: a space has no path, only
  the worker's descriptor. The family shares them; a fork takes the next,
  and an unused one costs a descriptor, not memory.
- **A namespace of its own, mounted from outside.** The copy, before any
  cell of its own runs, unshares a user and a mount namespace (and a
  network one when its session has no network), and waits. A helper of the
  worker maps the copy's ids (the same ids), enters its namespaces and
  mounts the spare's trees over ``/tmp``, ``/dev/shm`` and the home, with
  what was mounted beneath them (an interpreter that lives in ``/tmp``)
  again. The copy (which dropped the capabilities its namespace gave it
  as it unshared) copies its parent's files into them and enters a layer
  of its own
  (``copy_layer``): writing only its own trees and the family's unused
  spares, signals and abstract sockets scoped to itself. From then on it
  reaches neither its parent's files and processes nor its siblings'.

What it does not stop: an ancestor reaches its copies. A Landlock domain
may trace the domains nested in it, and the copy's user namespace is its
parent's user's, so a parent's process can open a copy's files through
``/proc/<pid>/root``, and join that namespace with every capability in
it -- over the ids mapped there, the parent's own: for a root session,
root's files in the trees its Landlock domain grants, nothing beyond
them. A file capability set there would be one on the host, so the
sandbox's seccomp filter refuses every extended attribute
(execpool/sandbox/seccomp.py). The threat model (docs/sandbox/threat-model.md) says so.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import stat
import time
from typing import Callable, List, Optional, Tuple

from ...sandbox.enter import STEP_ATTACH, STEP_SAVE, STEP_SPACE, STEP_WRITE, VIEW_INTO, child_arguments, make_view
from ...sandbox.rulesets import DEVICES, FS_TRUNCATE, FS_WRITE_FILE, READ, add_rules, build_ruleset
from ...sandbox.view import HOME, SHM, SPACE_DIRECTORIES, TMP
from ...shared.kernel.linux import mounts, open_unlinked
from ...tool.become import _spawn
from ..files import make_path
from ..helper_forks import fork_helper
from ..space import Space

#: How many copies a sandboxed session's family (it, its copies and
#: theirs) can make: each is a spare made when the session starts.
FAMILY_FORKS = 8
#: A copy's trees in its spare, and where its view mounts each (a session
#: given a working directory has a fourth: ``Family.trees``).
TREES = (("home", HOME), ("tmp", TMP), ("shm", SHM))
#: Landlock's ceiling on a process's layers (LANDLOCK_MAX_NUM_LAYERS). A
#: session has one and each copy adds one to its parent's, so a family's
#: forks, however nested, stay beneath it.
_MAX_LAYERS = 16
assert 1 + FAMILY_FORKS <= _MAX_LAYERS
#: How long the worker waits for the helper that mounts a copy's trees.
MOUNT_TIMEOUT_S = 5.0
_MOUNTER_NAME = "execpool-mount"


class Family:
    """The spares a sandboxed session and its copies share, removed when
    the last of them ends. ``trees``: the
    directories of each spare a copy gets and where its view mounts each --
    the home, /tmp, /dev/shm, and the session's working directory where the
    caller gave it one (at its own path)."""

    def __init__(self, spares: List[Space], trees: Tuple[Tuple[str, str], ...]) -> None:
        self.spares = spares
        self.trees = trees
        self.members = 1

    def take(self) -> Space:
        """The next spare, for a copy; OSError when none is left."""
        if not self.spares:
            raise OSError(f"a sandboxed session and its copies can make {FAMILY_FORKS} forks in all (each needs "
                          f"directories its first session's Landlock rules named when it started); they are made")
        self.members += 1
        return self.spares.pop(0)

    def left(self) -> List[Space]:
        """A member ended: the spares no copy took, once the last one has,
        to be removed -- never another family's: its Landlock domain grants
        them, and a process of it may outlive its last member's Result (one
        that left its session and its marker behind, or a daemon kept)."""
        self.members -= 1
        if self.members:
            return []
        unused, self.spares = self.spares, []
        return unused


class Spares:
    """The worker's stock of spares, made off a session's start (after a
    Result is out), so that starting one costs its rules, not its spaces.
    Each serves one family only, which lets go of those it did not use as
    it ends.

    ``make`` makes a space of a disk bound with given directories,
    ``release`` lets go of descriptors (the worker's remover)."""

    def __init__(self, make: Callable[[Optional[int], Tuple[Tuple[str, int], ...]], Space],
                 release: Callable[[List[int]], None]) -> None:
        self._make = make
        self._release = release
        self._stock: List[Space] = []
        #: The disk bound of the spares in stock: the last family's.
        self._disk: Optional[int] = None

    def family(self, ruleset: int, rights: int, cwd: Optional[str], disk: Optional[int]) -> Family:
        """FAMILY_FORKS spares of ``disk`` bytes for a session about to
        start (``cwd``: the working directory the caller gave it, if any),
        every right on their trees added to ``ruleset`` (the session's own,
        not yet entered)."""
        trees = TREES + ((("work", cwd),) if cwd is not None else ())
        if disk != self._disk:
            self.close()
            self._disk = disk
        self.refill()
        spares, self._stock = self._stock[:FAMILY_FORKS], self._stock[FAMILY_FORKS:]
        rules: List[Tuple[int, int]] = []
        try:
            for spare in spares:
                rules += [(fd, rights) for fd in spare.handles(tuple(name for name, _ in trees))]
            add_rules(ruleset, rules)
        except BaseException:
            self.remove(spares)
            raise
        finally:
            for fd, _ in rules:
                os.close(fd)
        return Family(spares, trees)

    def remove(self, spares: List[Space]) -> None:
        self._release([spare.take() for spare in spares])

    def refill(self) -> None:
        """Make what the stock lacks for the next session, once the worker
        has nothing more urgent (a Result just went out)."""
        while len(self._stock) < FAMILY_FORKS:
            self._stock.append(self._make(self._disk, _SPARE_DIRECTORIES))

    def close(self) -> None:
        self.remove(self._stock)
        self._stock.clear()


#: What a spare holds: a copy's home, /tmp, /dev/shm and working directory.
_SPARE_DIRECTORIES = (*SPACE_DIRECTORIES, ("work", 0o700))


def copy_layer(handled: int, scoped: int, spare: Space, family: Family) -> int:
    """The Landlock layer a copy enters once it has its own trees: writing
    only those, the family's unused spares (for its own forks) and the
    devices; reading is its parent's layers' business. A ruleset
    descriptor, for the caller to close."""
    writes = handled & ~READ
    opened: List[Tuple[int, int]] = []
    names = tuple(name for name, _ in family.trees)
    try:
        for directory in (spare, *family.spares):
            opened += [(fd, writes) for fd in directory.handles(names)]
        for device in DEVICES:
            try:
                opened.append((os.open(device, os.O_PATH | os.O_CLOEXEC), writes & (FS_WRITE_FILE | FS_TRUNCATE)))
            except OSError:
                continue
        return build_ruleset(writes, scoped, opened)
    finally:
        for fd, _ in opened:
            os.close(fd)


def mount_copy(pid: int, spare: Space, trees: Tuple[Tuple[str, str], ...], user_fd: int) -> None:
    """Give the copy ``pid`` (unshared, waiting) its own trees from
    ``spare``; OSError naming the step that failed. ``user_fd``: the user
    namespace of the copy's parent (execpool/worker/userns.py), above the
    copy's, where its ids are mapped from.

    The view's machinery does it (execpool/tool/_spawn.c's make_view, in
    a vfork child, or its ctypes twin in a helper without the extension):
    the copy's own user and group mapped, each to itself (no other: nothing
    joining its namespace can take another id); then, in the copy's mount
    namespace, the spare's trees cloned and each mounted over its place,
    with what was mounted beneath that place again on it. That namespace is
    its parent's until then, which the parent can still change: every path
    there is reached without following a link, and the directories the
    mounts need are made beforehand, here, in the spare, which no process
    of the family can reach yet."""
    targets = [target for _, target in trees]
    with open(f"/proc/{pid}/mountinfo") as f:
        mountinfo = f.read()
    # What is mounted beneath a tree goes on the copy's again -- but a tree
    # mounted in another (a working directory in /tmp), which is the copy's own.
    saved = [(path, target) for target in targets for path in _mounts_beneath(mountinfo, target)
             if path not in targets]
    root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for path, target in [*saved, *((other, target) for other in targets for target in targets
                                       if other != target and other.startswith(target.rstrip("/") + "/"))]:
            _make_in_spare(spare, trees, target, path, _is_dir(root, path))
    finally:
        os.close(root)
    steps = []
    with open(f"/proc/{pid}/status") as f:
        ids = dict(line.split(":", 1) for line in f if line.startswith(("Uid:", "Gid:")))
    steps.append((STEP_WRITE, os.fsencode(f"/proc/{pid}/setgroups"), b"deny"))  # no group dropped
    for name, key in (("uid_map", "Uid"), ("gid_map", "Gid")):
        own = ids[key].split()[1]  # the effective id: the copy's only one, as it was
        steps.append((STEP_WRITE, os.fsencode(f"/proc/{pid}/{name}"), f"{own} {own} 1\n".encode()))
    steps += [(STEP_SPACE, name.encode(), b"") for name, _ in trees]
    steps += [(STEP_SAVE, os.fsencode(path), b"") for path, _ in saved]
    steps += [(STEP_ATTACH, b"%d" % index, os.fsencode(target))
              for index, target in sorted(enumerate(targets), key=lambda pair: pair[1].count("/"))]
    steps += [(STEP_ATTACH, b"%d" % index, os.fsencode(path)) for index, (path, _) in enumerate(saved, len(trees))]
    copy_mnt = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check_own(pid, copy_mnt)
        view = (user_fd, copy_mnt, spare.fd, -1, tuple(steps), b"/", VIEW_INTO)
        if _spawn is not None:
            os.close(_spawn.prepare_view(child_arguments((), view)))
        else:
            _in_helper(lambda: make_view(view), (copy_mnt, spare.fd, *([user_fd] if user_fd >= 0 else [])))
    finally:
        os.close(copy_mnt)


def _check_own(pid: int, mnt: int) -> None:
    """OSError unless the mount namespace ``mnt`` is the copy's own: made in
    its new user namespace (a copy its parent's cell changed could have
    kept its parent's, or joined another)."""
    owner = fcntl.ioctl(mnt, _NS_GET_USERNS)
    try:
        if os.fstat(owner).st_ino != os.stat(f"/proc/{pid}/ns/user").st_ino:
            raise OSError("the session's copy did not make a mount namespace of its own")
    finally:
        os.close(owner)


#: ioctl(2) on a namespace's descriptor: its owning user namespace's (linux/nsfs.h).
_NS_GET_USERNS = 0xB701


def _is_dir(root: int, path: str) -> bool:
    """Whether ``path`` in the copy's namespace (its ``/proc/<pid>/root``)
    is a directory, reached without a link and without leaving it."""
    fd = open_unlinked(path.lstrip("/") or ".", beneath=root)
    try:
        return stat.S_ISDIR(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def _make_in_spare(spare: Space, trees: Tuple[Tuple[str, str], ...], target: str, path: str, is_dir: bool) -> None:
    """``path`` (beneath ``target``) made in the spare's tree for ``target``,
    a directory or an empty file: a mount point for the copy's view."""
    name = next(name for name, place in trees if place == target)
    inside = os.path.normpath(os.path.relpath(path, target))
    if inside.startswith(".."):
        raise OSError(f"{path} is not beneath {target}")
    tree = spare.directory(name)
    try:
        make_path(tree, inside, is_dir)
    finally:
        os.close(tree)


def _in_helper(body: Callable[[], None], keep: Tuple[int, ...]) -> None:
    """``body`` in a fork of the worker, which never changes namespaces
    itself, keeping the descriptors ``keep`` (and nothing else of the
    worker's); OSError with what it raised."""
    read_end, write_end = os.pipe()

    def run() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - said to the worker
            os.write(write_end, str(exc).encode("utf-8", "replace") or b"failed")

    try:
        helper = fork_helper(_MOUNTER_NAME, (write_end, *keep), run)
    finally:
        os.close(write_end)
    try:
        said = _read_until(read_end, time.monotonic() + MOUNT_TIMEOUT_S)
    finally:
        os.close(read_end)
    if said is None:
        os.kill(helper, signal.SIGKILL)
    os.waitpid(helper, 0)
    if said is None:
        raise OSError(f"mounting the copy's directories took over {MOUNT_TIMEOUT_S:g} s")
    if said:
        raise OSError(said.decode("utf-8", "replace"))


def _read_until(fd: int, deadline: float) -> Optional[bytes]:
    chunks: List[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _mounts_beneath(mountinfo: str, target: str) -> List[str]:
    """The mount points on the mount that is visible at ``target`` (not on
    one it covers: the view's own ``/tmp`` covers the template's)."""
    found = mounts(mountinfo)
    at_target = [ident for ident, _, point in found if point == target]
    covered = {parent for _, parent, point in found if point == target}
    top = next((ident for ident in reversed(at_target) if ident not in covered), None)
    return sorted({point for _, parent, point in found if parent == top and point != target})

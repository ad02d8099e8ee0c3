# The types of execpool/worker/_spawn.c, the workers' C extension: each
# function's docstring there says what it does.
from typing import List, Optional, Sequence, Tuple

def spawn(argv: List[str], env: List[str], cwd: str, limits: Tuple[int, ...], stdin_fd: int, out_fd: int,
          err_fd: int, no_network: bool, join_fds: List[int], sandbox: Optional[tuple], /) -> int: ...
def confine(ruleset_fds: Tuple[int, ...], seccomp_filter: bytes, last_cap: int, drop_bounding: bool,
            view: Optional[tuple], /) -> None: ...
def ruleset(handled_fs: int, scoped: int, rules: Sequence[Tuple[int, int]], handled_net: int = 0,
            ports: Sequence[Tuple[int, int]] = (), /) -> int: ...

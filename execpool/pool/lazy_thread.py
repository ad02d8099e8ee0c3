"""A thread of the caller's that exists only while it has work: the
cancel watcher's (execpool/pool/future.py) and the deadlines'
(execpool/pool/deadlines.py). An idle pool then holds no thread beyond
its dispatcher, and the next piece of work starts the thread again.

Runs in the caller.
"""

from __future__ import annotations

import abc
import threading
from typing import Optional


class OnDemandThread(abc.ABC):
    """The condition, the thread and the closed flag such a thread needs.
    A subclass adds work under ``_cond`` and calls :meth:`_wake`; its
    ``_run`` returns (setting ``_thread`` to None, under ``_cond``) once
    there is none, or once closed."""

    _name = "execpool-on-demand"

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def _wake(self) -> None:
        """(Under ``_cond``.) Start the thread if it is not running, and
        have it look at its work again."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._cond.notify()

    def close(self) -> None:
        """The thread ends, and no work is taken from now on."""
        with self._cond:
            self._closed = True
            self._drop()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    @abc.abstractmethod
    def _drop(self) -> None:
        """(Under ``_cond``, on close.) Forget pending work that is not to be done."""

    @abc.abstractmethod
    def _run(self) -> None:
        """The thread's body: the work, until there is none or it is closed."""

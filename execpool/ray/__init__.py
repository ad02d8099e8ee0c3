"""execpool on a Ray cluster: ``RayPool`` (execpool/ray/pool.py), run by the
driver, over one actor per node (execpool/ray/actor.py), run by Ray's worker
processes. ``pip install 'execpool[ray]'``; Ray itself is imported only
when a RayPool is made."""

from .pool import RayPool

__all__ = ["RayPool"]

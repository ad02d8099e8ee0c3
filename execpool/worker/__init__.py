"""The worker process and what runs inside it: ``python -m execpool.worker``
(__main__.py) runs the loop in event_loop.py; warm/ holds warm Python, whose
template and spares are processes of the worker's own. Nothing here is
imported by the caller's side, and nothing here imports it: the two meet
only in execpool/shared."""

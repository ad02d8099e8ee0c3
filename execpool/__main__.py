"""``python -m execpool``: the command line (execpool/cli)."""

from .cli.main import console_main

console_main()

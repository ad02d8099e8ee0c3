"""execpool's tests, a room per folder of the package (tests/pool/ for
execpool/pool/, ...) and tests/support/ for what they share. A package, so
that pytest puts the checkout on ``sys.path`` and every room imports the
support modules as ``tests.support.<name>``."""

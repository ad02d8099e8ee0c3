"""``execpool`` on the command line, run in the user's shell process:
main.py parses the arguments, run.py is ``execpool run``, batch.py
``execpool batch`` (lines.py reads its IN, out.py writes its OUT); ``execpool
serve`` is the service's own command (execpool/serve/command.py)."""

"""``execpool`` on the command line, run in the user's shell process:
main.py parses the arguments, run.py is ``execpool run``, batch.py
``execpool batch`` (jobs_file.py reads its IN, results_file.py writes its OUT); ``execpool
serve`` is the service's own command (execpool/serve/command.py)."""

"""The command line (execpool/cli/): `execpool run` and `execpool batch`."""

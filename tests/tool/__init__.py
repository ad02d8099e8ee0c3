"""The tool process (execpool/tool/): warm Python, sessions and their forks, IPython."""

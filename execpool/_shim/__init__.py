"""The directory execpool's Python tool puts first on ``PYTHONPATH`` so the
tool's interpreter imports ``sitecustomize`` from here at startup.

Nothing imports this package; it is one only so that packaging ships the
directory with execpool.
"""

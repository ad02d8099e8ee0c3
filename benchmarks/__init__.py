"""Benchmarks for execpool; run each as ``python benchmarks/NAME.py`` or ``python -m benchmarks.NAME``."""

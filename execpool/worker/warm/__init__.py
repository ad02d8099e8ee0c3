"""Warm Python inside a worker. Which process runs each file: template.py,
the template (``python -m execpool.worker.warm.template``); spare.py, each
spare the template clones; supply.py and handover.py, the worker itself;
wire.py, the words between the worker and its spares."""

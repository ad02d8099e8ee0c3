"""Warm Python, the worker's side: supply.py keeps the template and its
spares, handover.py hands a job to a spare. The template and the spares
themselves run the tool's code (execpool/tool/template.py, spare.py), and
the words between them and the worker are execpool/tool/spare_wire.py."""

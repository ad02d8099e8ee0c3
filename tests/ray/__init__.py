"""Ray (execpool/ray/): RayPool and `execpool batch --ray` on a real cluster."""

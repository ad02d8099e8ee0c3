"""The lifeline process: one per pool, the workers' parent, and what cleans
up after a pool whose owner died. Started as ``python -m execpool.lifeline``;
imports nothing but execpool/shared."""

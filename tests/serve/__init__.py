"""`execpool serve` (execpool/serve/), the real command over real HTTP."""

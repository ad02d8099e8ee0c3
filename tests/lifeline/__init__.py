"""The lifeline (execpool/lifeline/): nothing outlives the pool's owner."""

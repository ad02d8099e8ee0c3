"""The worker (execpool/worker/): what it does for a job and what a job cannot do to it."""

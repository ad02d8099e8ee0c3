"""The caller's side (execpool/pool/): submit and its outcomes, streams, faults, the layers on submit."""

"""`execpool eval` (execpool/eval/ and the judge in execpool/tool/)."""

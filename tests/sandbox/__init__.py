"""The sandbox (execpool/sandbox/ and what it is asked for): attacked, and unnoticed by ordinary code."""

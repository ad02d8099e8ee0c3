"""Modules both sides load (execpool/shared/)."""

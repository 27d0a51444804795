"""Fault detectors: each turns what it sees into a typed fault that the agent reports."""

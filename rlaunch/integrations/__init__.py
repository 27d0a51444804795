"""Bridges between rlaunch and the systems that run it (schedulers, cluster managers)."""

"""The node agent: configuration, worker processes, their environment and logs."""

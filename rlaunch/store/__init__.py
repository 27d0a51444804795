"""etcd: key paths, typed records, the client boundary and the embedded server."""

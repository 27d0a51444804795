"""Sleeps, with no child process; the rank named by $STUBBORN_RANK prints and ignores SIGTERM
(as a slow checkpoint handler would)."""

import os
import signal
import time

rank = os.environ["RANK"]
if rank == os.environ.get("STUBBORN_RANK"):
    signal.signal(signal.SIGTERM, lambda *_: print(f"rank {rank} got SIGTERM", flush=True))
print(f"stubborn ready, rank {rank}", flush=True)
while True:
    time.sleep(1)

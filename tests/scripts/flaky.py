"""Exits 3 on the rank named by $FAIL_RANK while TORCHELASTIC_RESTART_COUNT < $FAIL_TIMES; else succeeds."""

import os
import sys
import time

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {restart} rank {os.environ['RANK']}", flush=True)
if os.environ["RANK"] == os.environ.get("FAIL_RANK", "0") and restart < int(os.environ.get("FAIL_TIMES", "1")):
    time.sleep(0.5)
    sys.exit(3)
time.sleep(float(os.environ.get("RUN_S", "1.5")))

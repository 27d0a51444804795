"""Spawns a grandchild that sleeps, then sleeps itself: a process tree to stop."""

import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"sleeper ready, grandchild {child.pid}", flush=True)
time.sleep(600)

"""Writes a lot to stdout and stderr at once, to check that the launcher never lets a pipe fill."""

from __future__ import annotations

import os
import sys

rank = os.environ["RANK"]
line = "x" * 199
for i in range(20000):  # about 4 MB per stream
    print(f"{i} {line}")
    print(f"{i} {line}", file=sys.stderr)
print(f"rank {rank} done")

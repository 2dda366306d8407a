"""Worker for tests/launch/test_launch_exit.py (reliability finding 5): rank 1 leaves a daemon
thread inside a torch receive that completes while its interpreter finalizes (rank 0 sends once rank
1's exit handlers have run), the way a pipeline stage's receive thread can at the end of a
run. Python then aborts the process in torch's C++ (SIGABRT) unless the rank ends without
finalizing."""

from __future__ import annotations

import atexit
import threading
import time

import torch
import torch.distributed as dist

import flowtrain

flowtrain.init_distributed()
store = dist.distributed_c10d._get_default_store()
if dist.get_rank() == 1:
    buffer = torch.empty(4)
    work = dist.irecv(buffer, src=0)
    threading.Thread(target=work.wait, daemon=True, name="user-receive").start()
    atexit.register(lambda: store.set("exit-test/go", "1"))
else:
    store.wait(["exit-test/go"])
    time.sleep(0.1)  # rank 1 is finalizing by now
    try:
        dist.send(torch.ones(4), dst=1)
    except RuntimeError:
        pass  # rank 1 ended already
print("script done", flush=True)

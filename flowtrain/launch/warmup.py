"""What a replacement rank (``flowtrain launch --peer-recovery``) does before it asks to join
the survivors' group: the slow part of a rank's start that needs no group, so the survivors,
who wait for it from the moment it asks, wait as little as possible."""

from __future__ import annotations

import time

from flowtrain.log import get_logger

log = get_logger("flowtrain.peer_recovery")


def prepare() -> None:
    """What ``initialize`` would do after the group is formed and that needs no group:
    imports (torch._dynamo, which building an optimizer imports, the slowest), and the fused
    Adam kernel's compile (or load from numba's cache). The survivors
    wait for the replacement from the moment it asks to join until it has built its engine,
    so it does the slow part first."""
    started = time.monotonic()
    # torch.optim's Optimizer.__init__ imports torch._dynamo on first use: seconds
    import torch._dynamo  # noqa: F401

    import flowtrain.checkpoint.checkpointer  # noqa: F401
    import flowtrain.config.hf  # noqa: F401
    import flowtrain.engine.engine  # noqa: F401
    import flowtrain.optimizers  # noqa: F401
    import flowtrain.profiling  # noqa: F401
    import flowtrain.schedulers  # noqa: F401
    import flowtrain.telemetry  # noqa: F401

    try:
        import cuda_numba

        cuda_numba.warm_up(("adam",))  # Adam and AdamW, the usual choice
    except Exception as exc:  # noqa: BLE001 - only a head start; initialize warms up again
        log.debug("no kernel warm-up before joining", error=repr(exc))
    log.info("ready to join", seconds=round(time.monotonic() - started, 3))

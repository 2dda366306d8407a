"""DeepSpeed's ``deepspeed.checkpointing`` path, for scripts that ``import flowtrain as deepspeed``:
the activation-checkpointing API of ``flowtrain.activation_checkpointing``, re-exported."""

from flowtrain.activation_checkpointing import (
    checkpoint,
    configure,
    is_configured,
    non_reentrant_checkpoint,
    reset,
)

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]

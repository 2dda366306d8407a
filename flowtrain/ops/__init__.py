"""DeepSpeed's ``deepspeed.ops`` names that training scripts import: ``ops.adam``'s optimizers."""

from flowtrain.ops import adam

__all__ = ["adam"]

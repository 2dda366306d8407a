"""DeepSpeed's ``deepspeed.utils`` names that scripts import: ``zero_to_fp32``."""

from flowtrain.utils import zero_to_fp32

__all__ = ["zero_to_fp32"]

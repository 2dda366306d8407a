"""TrainingArguments for flowtrain's Trainer: HF's own, with ``deepspeed=`` kept for
flowtrain's engine rather than handed to the deepspeed package."""

from __future__ import annotations

from typing import Any

import transformers


class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` whose ``deepspeed`` (a config path or dict) is kept
    for flowtrain's engine as ``flowtrain_config`` and left None: HF's own handling of it needs
    the deepspeed package and would route training through accelerate's DeepSpeed plugin."""

    # annotations only (no new dataclass fields): HF's dataclass defines deepspeed
    deepspeed: Any
    flowtrain_config: Any

    def __post_init__(self) -> None:
        self.flowtrain_config = self.deepspeed
        self.deepspeed = None
        super().__post_init__()

"""TrainingArguments for flowtrain's Trainer: HF's own, with ``deepspeed=`` kept for
flowtrain's engine rather than handed to the deepspeed package."""

from __future__ import annotations

from typing import Any

import transformers


class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` whose ``deepspeed`` (a config path, a dict, or a
    JSON string) is for flowtrain's engine (``flowtrain_config``): HF's own set-up never sees
    it, since that needs the deepspeed package and would route training through accelerate's
    DeepSpeed plugin."""

    # annotations only (no new dataclass fields): HF's dataclass defines deepspeed
    deepspeed: Any
    flowtrain_config: Any

    def __post_init__(self) -> None:
        self.flowtrain_config = self.deepspeed
        self.deepspeed = None
        try:
            super().__post_init__()  # sets up the devices too, without DeepSpeed
        finally:
            # kept as given, so a copy (dataclasses.replace, to_dict) carries the config
            self.deepspeed = self.flowtrain_config

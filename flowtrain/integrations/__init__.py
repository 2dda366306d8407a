"""Routes into flowtrain from other libraries' training loops (``integrations.transformers``:
Hugging Face's Trainer). Each is imported on its own; none is loaded by ``import flowtrain``."""

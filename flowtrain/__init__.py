"""flowtrain: PyTorch training across processes as an actor/event pipeline."""

__version__ = "0.1.0"

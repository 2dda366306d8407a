"""Cost model and discrete-event simulator of a training step (built by the simulate issue)."""

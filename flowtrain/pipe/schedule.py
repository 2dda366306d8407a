"""The pipeline schedules, kept importable here for scripts written against this path; the
order itself lives in ``flowtrain.plan.schedule``."""

from flowtrain.plan.schedule import SCHEDULES, Op, bubble_fraction, max_in_flight, stage_ops

__all__ = ["SCHEDULES", "Op", "bubble_fraction", "max_in_flight", "stage_ops"]

"""The step plan: one training step as named tasks (``names``) over gradient buckets
(``buckets``), the pipeline schedule's order (``schedule``) and ZeRO-3's gathers (``stage3``),
built from a model's parameters (``workload``); executed for real by the engine's actors and in
virtual time by the simulator (``sims/``). Nothing here costs anything."""

from flowtrain.plan.buckets import BucketPlan, ParamSlot, plan_buckets, plan_units
from flowtrain.plan.step_plan import StepPlan, Task, build_step_plan

__all__ = ["BucketPlan", "ParamSlot", "StepPlan", "Task", "build_step_plan", "plan_buckets",
           "plan_units"]

"""The StepPlan: one training step as named tasks and gradient buckets, executed for real by the
engine's actors and in virtual time by the simulator (``sims/``)."""

from flowtrain.plan.step_plan import (
                                      BucketPlan,
                                      ParamSlot,
                                      StepPlan,
                                      Task,
                                      build_step_plan,
                                      plan_buckets,
                                      plan_units,
)

__all__ = ["BucketPlan", "ParamSlot", "StepPlan", "Task", "build_step_plan", "plan_buckets",
           "plan_units"]

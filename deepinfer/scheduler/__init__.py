"""Pure-Python scheduling of requests onto steps: catch-up on num_computed_tokens, token budget, running-
sequence cap, FCFS, preemption by recompute. Never imports a tensor library (a test checks)."""
from deepinfer.scheduler.config import SchedulerConfig
from deepinfer.scheduler.output import ScheduledRequest, SchedulerOutput, StepResult
from deepinfer.scheduler.request import Request, RequestStatus
from deepinfer.scheduler.scheduler import Scheduler

__all__ = [
    "Request", "RequestStatus", "ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput", "StepResult",
]

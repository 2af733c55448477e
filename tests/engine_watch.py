"""Test helpers that watch an engine's scheduler from outside (no hooks in the engine for tests)."""
from __future__ import annotations


def record_preemptions(llm) -> list[str]:
    """The ids the scheduler preempts from now on, appended as each step is scheduled."""
    preempted: list[str] = []
    schedule = llm.engine.scheduler.schedule

    def watched():
        out = schedule()
        preempted.extend(out.preempted_ids)
        return out

    llm.engine.scheduler.schedule = watched
    return preempted

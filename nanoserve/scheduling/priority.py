"""Priority scheduling (scheduling_policy="priority", vLLM v0.6.3's scheduler): every queue is sorted by
(priority, arrival), lower values first, so the head of waiting is the most urgent request and the tail of running
the first to give its blocks up; and an urgent newcomer that lacks blocks or a seat takes them from less urgent
running requests (V0's _schedule_priority_preemption). The core's FCFS scheduler is this with one priority."""
import bisect

from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.sequence import RequestQueue, Sequence, num_seats


def priority_key(seq: Sequence) -> tuple[int, int]:
    """Lower priority value first; ties by arrival (seq ids count up in arrival order)."""
    return seq.priority, seq.seq_id


class PriorityQueue(RequestQueue):
    """Sorted by priority_key: a preempted request goes back to its place, not to the front."""

    def add(self, seq: Sequence, front: bool = False) -> None:
        bisect.insort(self, seq, key=priority_key)


class PriorityScheduler(Scheduler):
    queue_class = PriorityQueue

    def _plan(self, out: SchedulerOutput) -> None:
        self._preempt_for_priority(out)
        super()._plan(out)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """While the most urgent waiting request lacks blocks or a seat, less urgent running ones give theirs up,
        least urgent first. They recompute, also with swap: a swapped victim would come back before the newcomer,
        which is waiting, and take its blocks back (where priority meets swap: nanoserve/chapters.py)."""
        if not self.waiting:
            return
        seq = self.waiting[0]
        while (self.running and priority_key(self.running[-1]) > priority_key(seq) and (
                num_seats(seq) > self.num_free_seats() or not self.block_manager.can_allocate(seq))):
            self._preempt_by_recompute(self.running.pop(), out)
            self.stats.num_priority_preemptions += 1


def check_priority(priority: object) -> None:
    """The request_checks seam: a priority is an integer."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")

"""Priority scheduling (scheduling_policy="priority", vLLM v0.6.3's scheduler): every queue is
sorted by (priority, arrival), lower values first, so the head of waiting is the most urgent request
and the tail of running the first to give its blocks up; and an urgent newcomer that lacks blocks or
a seat takes them from less urgent running requests (V0's _schedule_priority_preemption). The core's
FCFS scheduler is this with one priority."""
import bisect
from collections.abc import Callable

from nanoserve.config import Config
from nanoserve.engine.core import EngineCore
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import RequestQueue, Sequence, num_seats
from nanoserve.lora_request import LoRARequest
from nanoserve.sampling_params import SamplingParams

PriorityKey = Callable[[Sequence], tuple[int, int]]


class PriorityQueue(RequestQueue):
    """Sorted by the scheduler's priority key: a preempted request goes back to its place, not to
    the front."""

    def __init__(self, key: PriorityKey):
        super().__init__()
        self.key = key

    def add(self, seq: Sequence, front: bool = False) -> None:
        bisect.insort(self, seq, key=self.key)


class PriorityScheduler(Scheduler):
    """The scheduler with scheduling_policy="priority"; with "fcfs", the core's."""

    def __init__(self, config: Config, *args, **kwargs):
        self.is_priority = config.scheduler_config.scheduling_policy == "priority"
        self.priorities: dict[str, int] = {}  # request id -> its priority, while it is here
        super().__init__(config, *args, **kwargs)

    def priority_key(self, seq: Sequence) -> tuple[int, int]:
        """Lower priority value first; ties by arrival (seq ids count up in arrival order)."""
        return self.priorities.get(seq.request_id, 0), seq.seq_id

    def new_queue(self) -> RequestQueue:
        return PriorityQueue(self.priority_key) if self.is_priority else super().new_queue()

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        if all(s.is_finished for s in seq.group):
            self.priorities.pop(seq.request_id, None)

    def _plan(self, out: SchedulerOutput) -> None:
        if self.is_priority:
            self._preempt_for_priority(out)
        super()._plan(out)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """While the most urgent waiting request lacks blocks or a seat, less urgent running ones
        give theirs up, least urgent first. They recompute, also with swap: a swapped victim would
        come back before the newcomer, which is waiting, and take its blocks back (where priority
        meets swap: nanoserve/chapters.py)."""
        if not self.waiting:
            return
        seq, key = self.waiting[0], self.priority_key
        while (self.running and key(self.running[-1]) > key(seq) and (
                num_seats(seq) > self.num_free_seats()
                or not self.block_manager.can_allocate(seq))):
            self._preempt_by_recompute(self.running.pop(), out)
            self.stats.num_priority_preemptions += 1


class PriorityEngineCore(EngineCore):
    """Takes each request's priority (generate(..., priority=[...])) to the scheduler's books."""

    scheduler: PriorityScheduler

    def check_option(self, name: str, value: object) -> None:
        if name != "priority" or not self.scheduler.is_priority:
            return super().check_option(name, value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"priority must be an integer, got {value!r}")

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        args = request_id, prompt_token_ids, sampling_params, priority, lora_request
        if not self.scheduler.is_priority or request_id in self.requests:
            return super().add_request(*args)
        self.scheduler.priorities[request_id] = priority  # (its queue is sorted as it joins)
        try:
            super().add_request(*args)
        except BaseException:  # refused: nothing of it stays
            del self.scheduler.priorities[request_id]
            raise

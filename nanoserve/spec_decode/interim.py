"""Until nanoserve/chapters.py's composites (#51) list the chapter's subclasses: where it meets the
scheduler designs, async scheduling's engine and the ranks' executor. (Deleted at that merge.)"""
from nanoserve.parallel.executor import MultiprocExecutor
from nanoserve.scheduling.async_scheduling import BatchQueueEngineCore
from nanoserve.scheduling.priority import PriorityScheduler
from nanoserve.scheduling.swap import SwapScheduler
from nanoserve.spec_decode import SpecDecodeEngineCore, SpecDecodeExecutor
from nanoserve.spec_decode.scheduler import SpecDecodeScheduler


class SpecDecodePriorityScheduler(SpecDecodeScheduler, PriorityScheduler):
    pass


class SpecDecodeSwapScheduler(SpecDecodeScheduler, SwapScheduler):
    pass


class SpecDecodeBatchQueueEngineCore(SpecDecodeEngineCore, BatchQueueEngineCore):
    pass


class SpecDecodeMultiprocExecutor(SpecDecodeExecutor, MultiprocExecutor):
    pass


class SpecDecodePrioritySwapScheduler(SpecDecodeScheduler, PriorityScheduler, SwapScheduler):
    def _preempt_for_priority(self, out) -> None:  # (chapters.py's PrioritySwapScheduler's rule)
        if not self.swapped:
            super()._preempt_for_priority(out)


def scheduler_class(priority: bool, swap: bool) -> type[SpecDecodeScheduler]:
    if priority:
        return SpecDecodePrioritySwapScheduler if swap else SpecDecodePriorityScheduler
    return SpecDecodeSwapScheduler if swap else SpecDecodeScheduler

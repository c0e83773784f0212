"""Which ranks work together. An engine with P pipeline stages of T tensor-parallel ranks each is
P x T processes in one torch.distributed group: global rank r is stage r // T, tensor-parallel rank
r % T (rank 0 schedules).

The layers all-reduce within their stage's group (tp_group); a stage hands its activations to the
rank with the same tensor-parallel rank in the next stage (parallel/pipeline.py). With no process
group: one rank, one stage.
"""
import torch.distributed as dist

_tp_size = 1
_tp_group: dist.ProcessGroup | None = None  # None: the default group (one stage holds every rank)


def init_stage_groups(tp_size: int, pp_size: int) -> None:
    """After dist.init_process_group: a group per stage. new_group is collective, so every rank
    makes every stage's group, in the same order, and keeps its own."""
    global _tp_size, _tp_group
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)] \
        if pp_size > 1 else [None]
    _tp_size, _tp_group = tp_size, groups[dist.get_rank() // tp_size]


def destroy_stage_groups() -> None:
    """Leave torch.distributed (every group with it)."""
    global _tp_size, _tp_group
    _tp_size, _tp_group = 1, None
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_group() -> dist.ProcessGroup | None:
    return _tp_group


def tp_rank_size() -> tuple[int, int]:
    """This process's rank within its stage, and the stage's number of ranks."""
    return (dist.get_rank() % _tp_size, _tp_size) if dist.is_initialized() else (0, 1)


def pp_rank_size() -> tuple[int, int]:
    """This process's stage, and the number of stages."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank() // _tp_size, dist.get_world_size() // _tp_size

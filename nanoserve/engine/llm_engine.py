from itertools import count

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling_params import SamplingParams


class LLMEngine:
    """The loop that glues it together: schedule → run the model → postprocess, one step at a time."""

    def __init__(self, config: Config):
        self.config = config
        self.model_runner = ModelRunner(config)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.block_size,
                                          config.enable_prefix_caching)
        swap_pool = None
        if config.preemption_mode == "swap":  # a second allocator, over the model runner's host-memory pool
            swap_pool = BlockManager(self.model_runner.num_host_blocks, config.block_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(config, self.block_manager, swap_pool)
        self.seq_ids = count()

    def check_request(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Reject what could never run, before any work starts, instead of failing or looping later."""
        if not token_ids:
            raise ValueError("prompt: must contain at least one token")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority: got {priority}, but it needs scheduling_policy='priority'")
        max_len = self.config.max_model_len
        if len(token_ids) + params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({max_len})")
        vocab_size = self.config.hf_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab_size:
                raise ValueError(f"{name}: got {getattr(params, name)}, the vocabulary has {vocab_size} tokens")
        num_blocks = -(-(len(token_ids) + params.max_tokens) // self.config.block_size)
        if num_blocks > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {num_blocks} KV blocks but num_kvcache_blocks is "
                             f"{self.block_manager.num_blocks} (block_size {self.config.block_size})")

    def add_request(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> Sequence:
        self.check_request(token_ids, params, priority)
        seq = Sequence(next(self.seq_ids), token_ids, params, self.config.block_size, priority)
        self.scheduler.add(seq)
        return seq

    def step(self) -> tuple[list[Sequence], int, bool]:
        """One forward pass. Returns (sequences that finished, tokens computed, was it a prefill)."""
        out = self.scheduler.schedule()
        token_ids = self.model_runner.run(out)  # also when nobody runs: swapped-out blocks must be copied
        return self.scheduler.postprocess(out, token_ids), sum(out.num_scheduled_tokens), out.is_prefill

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.scheduler.abort(seq)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

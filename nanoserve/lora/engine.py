"""LoRA as a diff to the core: a subclass of each core class it changes, each inert unless the
config has a lora_config (enable_lora=True). nanoserve/chapters.py puts them in the engine's parts.

- LoRAEngineCore: add_request takes the adapter (lora_request), checks it, keeps it by request id
  in the LoRAManager and roots the request's block hashes in it.
- LoRAScheduler: can_admit holds back a request whose adapter would be one too many (vLLM v0.6.3's
  curr_loras).
- LoRAExecutor: launch loads the step's adapters into slots and points each row at its slot, on
  every rank.
- LoRAModelRunner: every rank's model, its target layers wrapped with slots (LoRASlots, layers.py).
"""
import numpy as np
import torch

from nanoserve.config import Config
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import Executor, ModelInput, ModelRunner
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.lora.layers import LoRASlots, add_lora_slots
from nanoserve.lora.manager import LoRAManager
from nanoserve.lora_request import LoRARequest
from nanoserve.sampling_params import SamplingParams


class LoRAEngineCore(EngineCore):
    """Requests' side: the LoRAManager, made here and shared with the scheduler and the executor."""

    scheduler: "LoRAScheduler"
    executor: "LoRAExecutor"

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.lora_manager = None if config.lora_config is None else LoRAManager(config)
        if self.lora_manager is not None:  # (the parts chapters.py built for it: LoRA's subclasses)
            self.scheduler.lora_manager = self.executor.lora_manager = self.lora_manager

    def check_option(self, name: str, value: object) -> None:
        """A lora_request's adapter is read into host memory, or a ValueError says what is wrong
        with it. (Without enable_lora the core refuses it.)"""
        if name != "lora_request" or self.lora_manager is None:
            return super().check_option(name, value)
        self.lora_manager.check(value)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        super().add_request(request_id, prompt_token_ids, sampling_params, priority, lora_request)
        if lora_request is not None:  # queued, not planned yet: no block of it is hashed
            self.lora_manager.lora_requests[request_id] = lora_request
            for seq in self.requests[request_id].seqs:  # the same tokens, another adapter: other KV
                seq.hash_root = lora_request.hash_root

    def _update_from_output(self, out: SchedulerOutput,
                            token_ids: list[int]) -> list[EngineCoreOutput]:
        """A request that ended is forgotten here, after the step's observers read its adapter."""
        outputs = super()._update_from_output(out, token_ids)
        if self.lora_manager is not None:
            for output in outputs:
                if output.finished and output.request_id not in self.requests:
                    self.lora_manager.lora_requests.pop(output.request_id, None)
        return outputs

    def abort_request(self, request_id: str) -> bool:
        if self.lora_manager is not None:
            self.lora_manager.lora_requests.pop(request_id, None)
        return super().abort_request(request_id)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """vLLM's add_lora: read an adapter ahead of its requests (the server's --lora-modules and
        /v1/load_lora_adapter); a ValueError names what is wrong with it."""
        if self.lora_manager is None:
            raise ValueError("lora_request: this engine serves no adapters; pass enable_lora=True")
        self.lora_manager.check(lora_request)


class LoRAScheduler(Scheduler):
    """vLLM v0.6.3's curr_loras: the running requests use at most max_loras adapters."""

    lora_manager: LoRAManager | None = None  # LoRAEngineCore's, with enable_lora

    def can_admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """A waiting request whose adapter would make one too many among the running ones is held
        back, keeping its place; base-model requests, and an adapter's already running, may go."""
        manager = self.lora_manager
        lora = None if manager is None else manager.lora_request(seq)
        if lora is not None:
            in_use = {running.lora_int_id for s in self.running
                      if (running := manager.lora_request(s)) is not None}
            if lora.lora_int_id not in in_use and len(in_use) >= manager.max_loras:
                return False
        return super().can_admit(seq, out)


class LoRAExecutor(Executor):
    """Before each forward, on every rank, in order with the step's other calls (so, with batches
    in flight, a slot never changes under a step that uses it): the slot loads, then each row's
    slot."""

    lora_manager: LoRAManager | None = None  # LoRAEngineCore's, with enable_lora

    def launch(self, out: SchedulerOutput,
               inputs: ModelInput | None) -> tuple[ModelInput | None, torch.Tensor | None]:
        if self.lora_manager is not None and inputs is not None:
            self.set_lora_rows(out)
        return super().launch(out, inputs)

    def set_lora_rows(self, out: SchedulerOutput) -> None:
        manager = self.lora_manager
        loads, seq_slots = manager.assign_slots(out.seqs)
        for slot, adapter in loads:  # (the adapter's weights whole: each rank keeps its share)
            self.call("load_lora", slot, adapter.weights, adapter.scaling)
        if seq_slots is None:
            if manager.rows_set:  # (base rows after adapter rows: the layers run the base model)
                self.call("set_lora_rows", None, False)
                manager.rows_set = False
            return
        row_slots = torch.from_numpy(np.repeat(seq_slots, [row.num_tokens for row in out.rows]))
        decode = len(row_slots) == len(seq_slots)  # a row per sequence
        self.call("set_lora_rows", row_slots, decode)
        manager.rows_set = True


class LoRAModelRunner(ModelRunner):
    """Every rank's LoRA (vLLM's LoRA model runner mixin): the target layers hold max_loras slots,
    which rank 0's LoRAExecutor fills (load_lora) and points each row at (set_lora_rows)."""

    def __init__(self, config: Config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        lora = config.lora_config
        self.lora_slots: LoRASlots | None = (
            None if lora is None else add_lora_slots(self, lora.max_loras, lora.max_lora_rank))

    def load_lora(self, slot: int, weights: dict, scaling: float) -> None:
        self.lora_slots.load(slot, weights, scaling)

    def set_lora_rows(self, row_slots: torch.Tensor | None, decode: bool) -> None:
        self.lora_slots.set_rows(row_slots, decode)

"""The LoRA feature's engine side (vLLM's LoRA manager): adapters read into host memory (an LRU of max_cpu_loras),
max_loras device slots loaded between steps, the scheduler's cap on adapters per step (vLLM v0.6.3's curr_loras),
and each step's row -> slot mapping. It runs on the process that plans; what it decides for the slots and rows,
every rank's LoRASlots (layers.py) carries out."""
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

from nanoserve.engine.core import EngineCore
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.lora.adapter import LoRAAdapter, read_adapter, target_shapes
from nanoserve.lora.layers import add_lora_slots, lora_slots_call
from nanoserve.lora_request import LoRARequest


class LoRAManager:
    def __init__(self, engine: EngineCore):
        config = engine.config
        lora = config.lora_config
        self.max_loras, self.max_rank = lora.max_loras, lora.max_lora_rank
        self.max_cpu_loras = lora.max_cpu_loras
        # (Weakly: the executor holds the seams, which hold this manager; a strong reference back would keep
        # `del llm` from stopping tensor-parallel workers at once.)
        self.executor = weakref.proxy(engine.executor)
        self.executor.call("apply", add_lora_slots, self.max_loras, self.max_rank)  # every rank's layers
        self.shapes, self.num_layers = target_shapes(config.hf_config), config.hf_config.num_hidden_layers
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, least recent first
        self.paths: dict[int, str] = {}  # every id seen -> its folder: an id keys the prefix cache, so it stays one
        self.slots: list[int | None] = [None] * self.max_loras  # the adapter id in each device slot
        self.slot_order: list[int] = list(range(self.max_loras))  # slots, least recently used first
        self.rows_set = False  # whether the layers hold adapter rows (else they run the base model)
        self.lock = threading.Lock()  # AsyncLLM checks requests in the caller's thread, steps in the engine's

    @classmethod
    def plug_in(cls, engine: EngineCore) -> "LoRAManager":
        manager = cls(engine)
        engine.seams.request_checks["lora_request"] = manager.check
        engine.seams.admits.append(manager.admits)
        engine.seams.before_forward.append(manager.before_forward)
        return manager

    def on_every_rank(self, method: str, *args) -> None:
        """Each rank's LoRASlots.method(*args): the executor sends the call to the workers of tensor parallelism
        (in order, before the step's forward) and runs it on rank 0."""
        self.executor.call("apply", lora_slots_call, method, *args)

    # ---- requests: read the adapter, or say what is wrong with it ---------------------------------
    def check(self, lora: LoRARequest) -> None:
        """The request_checks seam (EngineCore.check_request): the adapter is read (or found read) before it is
        queued."""
        with self.lock:
            if self.paths.setdefault(lora.lora_int_id, lora.lora_path) != lora.lora_path:
                raise ValueError(f"lora_request: lora_int_id {lora.lora_int_id} is already the adapter at "
                                 f"{self.paths[lora.lora_int_id]}, not {lora.lora_path}")
            try:
                self._host_adapter(lora)
            except ValueError:
                del self.paths[lora.lora_int_id]  # (a folder fixed later may take the id)
                raise

    def _host_adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read from its folder if the LRU evicted it (or never had it)."""
        adapter = self.host.pop(lora.lora_int_id, None)
        if adapter is None:
            adapter = read_adapter(lora, self.shapes, self.num_layers, self.max_rank)
        self.host[lora.lora_int_id] = adapter  # the most recently used, last
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    # ---- scheduling: at most max_loras adapters in the running batch ----------------------------------
    def admits(self, seq: Sequence, scheduler, out: SchedulerOutput) -> bool:
        """The scheduler's admission seam (vLLM v0.6.3's scheduler): may seq join the running ones
        without making more than max_loras adapters among them? Base-model requests always may."""
        if seq.lora_request is None:
            return True
        in_use = {s.lora_request.lora_int_id for s in scheduler.running if s.lora_request is not None}
        return seq.lora_request.lora_int_id in in_use or len(in_use) < self.max_loras

    # ---- each step, before its forward: slots, then each row's slot ------------------------------------
    def before_forward(self, out: SchedulerOutput, inputs) -> None:
        step = {s.lora_request.lora_int_id: s.lora_request for s in out.seqs if s.lora_request is not None}
        if not step:
            if self.rows_set:  # (a step of base rows after adapter rows: the layers go back to the base model)
                self.on_every_rank("set_rows", None)
                self.rows_set = False
            return
        slot_of = {lora_id: self._slot(lora, step) for lora_id, lora in step.items()}
        seq_slots = [slot_of[s.lora_request.lora_int_id] if s.lora_request is not None else -1 for s in out.seqs]
        num_tokens = [row.num_tokens for row in out.rows]
        row_slots = torch.from_numpy(np.repeat(seq_slots, num_tokens))  # -1: the base model
        self.on_every_rank("set_rows", row_slots, len(row_slots) == len(seq_slots))  # decode: a row per sequence
        self.rows_set = True

    def _slot(self, lora: LoRARequest, step: dict[int, LoRARequest]) -> int:
        """The device slot holding lora, loaded into the least recently used slot no adapter of this step holds
        if it is not in one already (at most max_loras adapters per step: the scheduler saw to it)."""
        if lora.lora_int_id in self.slots:
            slot = self.slots.index(lora.lora_int_id)
        else:
            with self.lock:
                adapter = self._host_adapter(lora)
            slot = next(s for s in self.slot_order if self.slots[s] not in step)
            self.on_every_rank("load", slot, adapter.weights, adapter.scaling)
            self.slots[slot] = lora.lora_int_id
        self.slot_order.remove(slot)
        self.slot_order.append(slot)
        return slot

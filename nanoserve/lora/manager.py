"""The LoRA chapter's state on the process that plans (vLLM's LoRA manager): each request's adapter,
by request id; adapters read into host memory (an LRU of max_cpu_loras); what each of the max_loras
device slots holds. LoRAEngineCore makes one and hands it to its scheduler and its executor
(lora/engine.py), which act on it."""
import threading
from collections import OrderedDict

from nanoserve.config import Config
from nanoserve.engine.sequence import Sequence
from nanoserve.lora.adapter import LoRAAdapter, read_adapter, target_shapes
from nanoserve.lora_request import LoRARequest


class LoRAManager:
    def __init__(self, config: Config):
        lora, hf_config = config.lora_config, config.hf_config
        self.max_loras, self.max_rank = lora.max_loras, lora.max_lora_rank
        self.max_cpu_loras = lora.max_cpu_loras
        self.shapes, self.num_layers = target_shapes(hf_config), hf_config.num_hidden_layers
        # request id -> its adapter, until the request ends (vLLM keeps it on the request)
        self.lora_requests: dict[str, LoRARequest] = {}
        # lora_int_id -> adapter, least recently used first
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # every id seen -> its folder: an id keys the prefix cache, so it stays one adapter
        self.paths: dict[int, str] = {}
        self.slots: list[int | None] = [None] * self.max_loras  # the adapter id in each device slot
        self.slot_order: list[int] = list(range(self.max_loras))  # least recently used first
        self.rows_set = False  # whether the layers hold adapter rows (else: the base model)
        # AsyncLLM checks requests in the caller's thread, and steps in the engine's
        self.lock = threading.Lock()

    # ---- requests: read the adapter, or say what is wrong with it ------------------------------
    def check(self, lora: LoRARequest) -> None:
        """The adapter is read (or found read) before its request is queued."""
        with self.lock:
            if self.paths.setdefault(lora.lora_int_id, lora.lora_path) != lora.lora_path:
                raise ValueError(f"lora_request: lora_int_id {lora.lora_int_id} is already the "
                                 f"adapter at {self.paths[lora.lora_int_id]}, not {lora.lora_path}")
            try:
                self._host_adapter(lora)
            except ValueError:
                del self.paths[lora.lora_int_id]  # (a folder fixed later may take the id)
                raise

    def _host_adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read from its folder if the LRU evicted it (or never had
        it)."""
        adapter = self.host.pop(lora.lora_int_id, None)
        if adapter is None:
            adapter = read_adapter(lora, self.shapes, self.num_layers, self.max_rank)
        self.host[lora.lora_int_id] = adapter  # the most recently used, last
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def lora_request(self, seq: Sequence) -> LoRARequest | None:
        """seq's adapter; None: the base model (or, with async scheduling, a request that ended
        while a step planned with it was still to run: that row's token is dropped)."""
        return self.lora_requests.get(seq.request_id)

    # ---- each step, before its forward: slots, then each sequence's slot ------------------------
    def assign_slots(self, seqs: list[Sequence]
                     ) -> tuple[list[tuple[int, LoRAAdapter]], list[int] | None]:
        """The step's adapters in slots: the loads it needs (slot, adapter), and each sequence's
        slot (-1: the base model), None when no sequence uses an adapter."""
        loras = [self.lora_request(seq) for seq in seqs]
        step = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if not step:
            return [], None
        loads, slot_of = [], {}
        for lora_id, lora in step.items():
            if lora_id in self.slots:
                slot = self.slots.index(lora_id)
            else:  # the least recently used slot no adapter of this step holds (the scheduler
                # let in at most max_loras adapters)
                slot = next(s for s in self.slot_order if self.slots[s] not in step)
                with self.lock:
                    loads.append((slot, self._host_adapter(lora)))
                self.slots[slot] = lora_id
            self.slot_order.remove(slot)
            self.slot_order.append(slot)
            slot_of[lora_id] = slot
        return loads, [-1 if lora is None else slot_of[lora.lora_int_id] for lora in loras]

"""A LoRA adapter a request asks for, as vLLM spells it:
`LoRARequest(lora_name, lora_int_id, lora_path)`.

A leaf record (no torch), importable anywhere: the core's API takes it (`lora_request=`) and passes
it on; the LoRA chapter (nanoserve/lora/) keeps it by request id, roots the request's block hashes
in its hash_root, and reads and serves the adapter.
"""
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # the adapter's name (the server's "model" field selects it)
    lora_int_id: int  # its id, >= 1, unique per adapter: the slots and the caches know it by this
    lora_path: str  # a PEFT folder: adapter_config.json and adapter_model.safetensors

    def __post_init__(self) -> None:
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a folder, got {self.lora_path!r}")

    @property
    def hash_root(self) -> int:
        """The hash a sequence's first KV block chains from (base model: -1): the same tokens under
        two adapters have different KV, so their blocks must never be hit across adapters (vLLM's
        extra keys)."""
        return xxhash.xxh64(f"lora:{self.lora_int_id}".encode()).intdigest()


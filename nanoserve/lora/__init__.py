"""LoRA adapters, many in one batch (vLLM's enable_lora): `LLM(model, enable_lora=True, max_loras=4)` and
`generate(..., lora_request=LoRARequest(name, id, path))`. adapter.py reads PEFT's format, layers.py batches the
matmuls of rows with different adapters, manager.py plugs it into the engine's seams (engine/seams.py)."""
from nanoserve.lora.manager import LoRAManager

__all__ = ["LoRAManager"]

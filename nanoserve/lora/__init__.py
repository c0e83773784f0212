"""LoRA adapters, many in one batch (vLLM's enable_lora): `LLM(model, enable_lora=True,
max_loras=4)` and `generate(..., lora_request=LoRARequest(name, id, path))`. adapter.py reads PEFT's
format, layers.py batches the matmuls of rows with different adapters, manager.py keeps the
chapter's state, and engine.py holds its subclasses of the core's engine core, scheduler, executor
and model runner (nanoserve/chapters.py puts them in the engine)."""

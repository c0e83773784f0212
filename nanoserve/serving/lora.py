"""The models a server answers to (vLLM's OpenAIServingModels): the base model and its LoRA
adapters.

`nanoserve serve MODEL --enable-lora --lora-modules name=path ...` serves each adapter under its own
model name; a request's `"model"` picks one (a LoRARequest with the id the name got when it was
loaded), and an unknown name is a 404. /v1/models lists the adapters beside the base model, each
with `parent` naming it. With --allow-runtime-lora-updating (off by default: whoever can reach the
server could load files from its disk), POST /v1/load_lora_adapter and /v1/unload_lora_adapter add
and remove adapters while the server runs.
"""
import json
from dataclasses import dataclass
from itertools import count

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from nanoserve.lora_request import LoRARequest
from nanoserve.serving.protocol import APIError, RequestModel


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModulePath:
    """One --lora-modules item: `name=path`, or vLLM's JSON `{"name": ..., "path": ...}`."""
    if text.lstrip().startswith("{"):
        item = json.loads(text)
        if (not isinstance(item, dict) or not isinstance(item.get("name"), str)
                or not isinstance(item.get("path"), str)):
            raise ValueError(f"--lora-modules: {text} must be name=path or "
                             f"{{\"name\": ..., \"path\": ...}}")
        return LoRAModulePath(item["name"], item["path"])
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise ValueError(f"--lora-modules: {text} must be name=path or "
                         f"{{\"name\": ..., \"path\": ...}}")
    return LoRAModulePath(name, path)


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_int_id: int | None = None  # (vLLM's body has it; the name alone says which)


class ServedModels:
    """The base model's name and the adapters loaded, by name. The engine core checks an adapter
    (reads its folder) when it is added, so a request naming it fails on nothing but its own
    fields."""

    def __init__(self, core, base_model_name: str, max_model_len: int):
        self.core, self.base_model_name, self.max_model_len = core, base_model_name, max_model_len
        self.lora_requests: dict[str, LoRARequest] = {}
        # never reused: an id keys the prefix cache's blocks and the engine's slots
        self.lora_ids = count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Load an adapter under a new name; a ValueError names what is wrong (the name, or the
        folder)."""
        if name == self.base_model_name or name in self.lora_requests:
            raise ValueError(f"lora_name: the model `{name}` is already served")
        if self.core.config.lora_config is None:
            raise ValueError("lora_name: this server serves no adapters; "
                             "start it with --enable-lora")
        lora = LoRARequest(name, next(self.lora_ids), path)
        self.core.add_lora(lora)  # (LoRAEngineCore's) reads the folder, or says what is wrong
        self.lora_requests[name] = lora
        return lora

    def remove(self, name: str) -> None:
        """Requests already running keep their adapter; new ones can no longer name it."""
        if self.lora_requests.pop(name, None) is None:
            raise APIError(404, f"The lora adapter `{name}` cannot be found.", "lora_name",
                           "model_not_found")

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """A request's `model`: the base model (None), one of the adapters, or a 404."""
        if model in (None, self.base_model_name):
            return None
        if model not in self.lora_requests:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return self.lora_requests[model]

    def cards(self) -> list[dict]:
        """/v1/models: the base model, then each adapter with its folder (`root`) and its base model
        (`parent`)."""
        card = dict(object="model", created=0, owned_by="nanoserve",
                    max_model_len=self.max_model_len)
        return [dict(id=self.base_model_name, **card)] + [
            dict(id=name, root=lora.lora_path, parent=self.base_model_name, **card)
            for name, lora in self.lora_requests.items()]


def add_lora_routes(router: APIRouter, models: ServedModels) -> None:
    """POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
    {"lora_name"}, answered as vLLM does: a line of text. A bad adapter is a 400 naming the field,
    and the server serves on."""

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        try:
            models.add(request.lora_name, request.lora_path)
        except ValueError as e:  # the name's fault if it says so, else the folder's
            param = "lora_name" if str(e).startswith("lora_name") else "lora_path"
            raise APIError(400, str(e), param) from e
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        models.remove(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed "
                                 "successfully.")

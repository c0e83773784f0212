import gc
from collections.abc import Callable
from dataclasses import replace
from itertools import count
from time import perf_counter

from tqdm.auto import tqdm

from nanoserve.config import Config, make_config
from nanoserve.engine.core import EngineCore
from nanoserve.engine.output_processor import RequestState
from nanoserve.engine.stats import SchedulerStats
from nanoserve.lora_request import LoRARequest
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict
Params = SamplingParams | list[SamplingParams] | None
LoRAs = LoRARequest | list[LoRARequest | None] | None


def prompt_token_ids(tokenizer, prompt: Prompt) -> list[int]:
    """A prompt is text, token ids or {"prompt_token_ids": [...]} / {"prompt": text}, as in vLLM."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return list(ids) if ids is not None else prompt_token_ids(tokenizer, prompt["prompt"])
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model folder has no tokenizer; "
                             "pass token ids instead of text")
        return tokenizer.encode(prompt)
    return list(prompt)


def prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids, a dict) or a list of them, as a list."""
    one = isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int))
    return [prompts] if one else prompts


def one_per_prompt(name: str, value, num_prompts: int) -> list:
    """An argument given once for every prompt, or as a list with one per prompt."""
    values = value if isinstance(value, list) else [value] * num_prompts
    if len(values) != num_prompts:
        raise ValueError(f"{name}: got {len(values)} for {num_prompts} prompts")
    return values


def prompt_text(prompt: Prompt) -> str | None:
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    return text if isinstance(text, str) else None


class LLM:
    """The offline API, shaped as vLLM's: `LLM(model, **config).generate(prompts, sampling_params)`.
    It steps the EngineCore itself until every request it added is done. This is the core's:
    `nanoserve.LLM` (nanoserve/chapters.py) is the same with the features plugged in
    (`build_engine`)."""

    build_engine: Callable[[Config], EngineCore] = EngineCore  # plain engine: no feature plugged in

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = type(self).build_engine(make_config(model, kwargs))
        self.tokenizer = self.engine.tokenizer
        self.request_ids = count()

    @property
    def stats(self) -> SchedulerStats:
        return self.engine.scheduler.stats

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: Params = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRAs = None) -> list[RequestOutput]:
        """priority (scheduling_policy="priority"): one per prompt; lower values are served first.
        lora_request (enable_lora=True): the adapter for every prompt, or one per prompt (None: the
        base model)."""
        prompts = prompt_list(prompts)
        sampling_params = one_per_prompt("sampling_params", sampling_params or SamplingParams(),
                                         len(prompts))
        priority = one_per_prompt("priority", priority or 0, len(prompts))
        loras = one_per_prompt("lora_request", lora_request, len(prompts))
        token_ids = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        # all checked before any is queued
        for request in zip(token_ids, sampling_params, priority, loras):
            self.engine.check_request(*request)
        final = {id(p): replace(p, output_kind=RequestOutputKind.FINAL_ONLY)  # (as vLLM)
                 for p in sampling_params}
        sampling_params = [final[id(p)] for p in sampling_params]
        return self._add_and_run(
            prompts, token_ids, [p.n for p in sampling_params], use_tqdm, lambda request_id, i: (
                self.engine.add_request(request_id, token_ids[i], sampling_params[i], priority[i],
                                        loras[i])))

    def _add_and_run(self, prompts: list[Prompt], token_ids: list[list[int]], ns: list[int],
                     use_tqdm: bool, add: Callable[[str, int], None]) -> list[RequestOutput]:
        """Queue every prompt (add(request_id, i) adds prompt i; ns[i] sequences come back), then
        step until done."""
        states = {}
        for i, (prompt, ids, n) in enumerate(zip(prompts, token_ids, ns)):
            request_id = str(next(self.request_ids))
            states[request_id] = RequestState(request_id, prompt_text(prompt), ids,
                                              RequestOutputKind.FINAL_ONLY, n)
            add(request_id, i)
        pbar = tqdm(total=len(states), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        finals, num_tokens, start = {}, 0, perf_counter()
        # as vLLM: what is alive now (torch, the model) is left out of full collections, ~0.2 s each
        gc.freeze()
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.error is not None:
                        raise out.error
                    num_tokens += len(out.new_token_ids)
                    final = states[out.request_id].update(out)  # None until the request finishes
                    if final is not None:
                        finals[out.request_id] = final
                        pbar.update(1)
                pbar.set_postfix(output=f"{num_tokens / (perf_counter() - start):.0f} tok/s")
        except BaseException:
            for request_id in states:  # give back their KV blocks so the engine stays usable
                self.engine.abort_request(request_id)
            raise
        finally:
            pbar.close()
            gc.unfreeze()
        return [finals[request_id] for request_id in states]

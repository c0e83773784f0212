import os
from dataclasses import fields
from time import perf_counter

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanoserve.config import Config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.scheduler import SchedulerStats
from nanoserve.engine.sequence import Sequence
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.utils.default_model import resolve_model

Prompt = str | list[int] | dict
Params = SamplingParams | list[SamplingParams] | None


class LLM:
    """The offline API, shaped like vLLM's: `LLM(model, **config).generate(prompts, sampling_params)`."""

    def __init__(self, model: str | None = None, **kwargs):
        names = {f.name for f in fields(Config) if f.init}
        unknown = set(kwargs) - names
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}; options are {sorted(names - {'model'})}")
        path = resolve_model(model)
        self.engine = LLMEngine(Config(path, **kwargs))
        has_tokenizer = any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
        self.tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None

    @property
    def stats(self) -> SchedulerStats:
        return self.engine.scheduler.stats

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            return list(ids) if ids is not None else self._token_ids(prompt["prompt"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model folder has no tokenizer; pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: Params = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """priority (scheduling_policy="priority"): one per prompt; lower values are served first."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} for {len(prompts)} prompts")
        token_ids = [self._token_ids(p) for p in prompts]
        requests = list(zip(token_ids, sampling_params, priority))
        for request in requests:  # all checked before any request is queued
            self.engine.check_request(*request)
        seqs = [self.engine.add_request(*request) for request in requests]
        try:
            self._run(seqs, use_tqdm)
        except BaseException:
            self.engine.abort(seqs)  # give back their KV blocks so the engine stays usable
            raise
        return [self._output(p, seq) for p, seq in zip(prompts, seqs)]

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> None:
        pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        while not all(seq.is_finished for seq in seqs):
            t = perf_counter()
            finished, num_tokens, is_prefill = self.engine.step()
            tps = num_tokens / (perf_counter() - t)
            prefill_tps, decode_tps = (tps, decode_tps) if is_prefill else (prefill_tps, tps)
            pbar.set_postfix(prefill=f"{prefill_tps:.0f} tok/s", decode=f"{decode_tps:.0f} tok/s")
            pbar.update(len(finished))
        pbar.close()

    def _output(self, prompt: Prompt, seq: Sequence) -> RequestOutput:
        ids = seq.completion_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
        completion = CompletionOutput(0, text, ids, seq.finish_reason, seq.logprobs)
        text_prompt = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        text_prompt = text_prompt if isinstance(text_prompt, str) else None
        return RequestOutput(str(seq.seq_id), text_prompt, seq.prompt_token_ids,
                             seq.num_cached_tokens, [completion], prompt_logprobs=seq.prompt_logprobs)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: Params = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        if self.tokenizer is None:
            raise ValueError("chat: this model folder has no tokenizer, so it has no chat template")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in conversations]
        # The template already holds any special tokens (BOS): do not let encode add them twice.
        prompts = [{"prompt": t, "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)}
                   for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

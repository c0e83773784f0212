from nanoserve.engine.core import EngineCoreOutput
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import RequestOutputKind


class RequestState:
    """One request in a front end (LLM, AsyncLLM): gathers its EngineCoreOutputs, step by step, into the
    RequestOutputs its output_kind asks for."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], kind: RequestOutputKind):
        self.request_id, self.prompt, self.prompt_token_ids, self.kind = request_id, prompt, prompt_token_ids, kind
        self.text = ""
        self.token_ids: list[int] = []

    def update(self, out: EngineCoreOutput) -> RequestOutput | None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        if self.kind == RequestOutputKind.FINAL_ONLY and not out.finished:
            return None
        delta = self.kind == RequestOutputKind.DELTA
        completion = CompletionOutput(0, out.new_text if delta else self.text,
                                      list(out.new_token_ids if delta else self.token_ids),
                                      out.finish_reason, out.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, out.num_cached_tokens,
                             [completion], out.finished)

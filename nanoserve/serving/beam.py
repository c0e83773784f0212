"""vLLM's `use_beam_search: true` on /v1/completions and /v1/chat/completions: the engine's beam
search (LLM.beam_search, docs/beam_search.md) behind OpenAI's routes, answered whole, never
streamed.

- The beam width is `best_of` if given, else `n` (vLLM V0's rule); the `n` best sequences are the
  choices, best first. `max_tokens`, `ignore_eos`, `temperature`, `length_penalty` and
  `early_stopping` go to BeamSearchParams.
- A field only sampling reads (SAMPLING_ONLY) is refused when set, rather than silently ignored; so
  are the beam-only fields (BEAM_ONLY) without use_beam_search.
"""
from collections.abc import AsyncIterator
from dataclasses import replace

from nanoserve.beam_search_params import BeamSearchParams
from nanoserve.outputs import RequestOutput
from nanoserve.serving.protocol import APIError, SamplingRequest

SAMPLING_ONLY = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens", "stop", "stop_token_ids",
                 "include_stop_str_in_output", "priority", "logprobs", "top_logprobs", "echo",
                 "response_format", "structured_outputs", "tools", "tool_choice")
BEAM_ONLY = ("best_of", "length_penalty", "early_stopping")


def check_beam_fields(request: SamplingRequest) -> None:
    """Each field set where this request's kind (beam search or sampling) would not read it: a 400
    naming it."""
    fields = type(request).model_fields
    if not request.use_beam_search:
        for name in BEAM_ONLY:
            value = getattr(request, name)
            if value != fields[name].default and not (name == "best_of" and value == request.n):
                raise APIError(400, f"{name}: only with use_beam_search=true", name)
        return
    if request.stream:
        raise APIError(400,
                       "stream: use_beam_search is answered whole; streaming it is not supported",
                       "stream")
    for name in SAMPLING_ONLY:
        if name in fields and getattr(request, name) != fields[name].default:
            raise APIError(400, f"{name}: not with use_beam_search (beam search does not sample)",
                           name)


def width_field(request: SamplingRequest) -> str:
    """The field that sets the beam width, as the client wrote it: the errors about the width name
    it."""
    return "n" if request.best_of is None else "best_of"


def beam_search_params(request: SamplingRequest, max_tokens: int | None, room: int,
                       max_num_seqs: int) -> BeamSearchParams:
    """room: what max_model_len leaves after the prompt, the default max_tokens."""
    field = width_field(request)
    width = getattr(request, field)
    if request.n < 1:
        raise APIError(400, f"n must be >= 1, got {request.n}", "n")
    if width < request.n:
        raise APIError(400, f"best_of must be >= n ({request.n}), got {width}", "best_of")
    if width > max_num_seqs:  # a request's beams run together, each a sequence
        raise APIError(400,
                       f"{field}: a beam width of {width} exceeds max_num_seqs ({max_num_seqs})",
                       field)
    return BeamSearchParams(beam_width=width,
                            max_tokens=max(room, 1) if max_tokens is None else max_tokens,
                            ignore_eos=request.ignore_eos, temperature=request.temperature,
                            length_penalty=request.length_penalty,
                            early_stopping=request.early_stopping)


def beam_search_streams(engine, request: SamplingRequest, prompts: list[list[int]],
                        max_tokens: int | None,
                        request_id: str) -> list[AsyncIterator[RequestOutput]]:
    """Check every prompt's search (a ValueError the route turns into a 400), then one
    engine.beam_search per prompt (engine: an AsyncLLM), each giving its n best sequences."""
    config = engine.engine_core.config
    params = [beam_search_params(request, max_tokens, config.max_model_len - len(p),
                                 config.max_num_seqs)
              for p in prompts]
    for ids, bp in zip(prompts, params):
        try:
            engine.check_beam_request(ids, bp)
        except ValueError as e:
            # the engine's limits on beam search itself, as the client's fields: the width
            # (more candidates than the vocabulary holds), or the server's options
            # (--async-scheduling, ...)
            prefixes = {"beam_width": width_field(request), "beam search:": "use_beam_search"}
            field = next((f for prefix, f in prefixes.items() if str(e).startswith(prefix)), None)
            if field is None:
                raise
            raise APIError(400, f"{field}: {e}", field) from e
    return [n_best(engine.beam_search(ids, bp, request_id=f"{request_id}-{i}"), request.n)
            for i, (ids, bp) in enumerate(zip(prompts, params))]


async def n_best(outputs: AsyncIterator[RequestOutput], n: int) -> AsyncIterator[RequestOutput]:
    """A search's one output as its n best sequences, an output each and the last one finished: the
    shape of sampling's delta outputs, which the route joins into choices."""
    async for out in outputs:
        for c in out.outputs[:n]:
            yield replace(out, outputs=[c], finished=c.index == n - 1)

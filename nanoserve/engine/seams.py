"""The seams: the places a feature plugs into the core's step, in one file, numbered in the order a step meets them.

The core (nanoserve/llm.py, this package, models/, layers/) is a complete engine with none of them, and never
imports a feature. A chapter that changes a part of the engine as a whole is a subclass of that part's core class
(the scheduler designs, the persistent batch, the ranks' executor, the window's block manager); the others
(speculative decoding, beam search, structured outputs, LoRA, logprobs, step records, ...) import
the core and add themselves here. nanoserve/chapters.py is the one place that builds an engine from its config.
With every list empty, as for a plain request, the core runs no feature code.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.sequence import Request, Sequence
from nanoserve.layers.sampling_metadata import LogitsProcessor

# (the step's plan, each sequence that got tokens -> how many) -> outputs of the requests the hook finished
AfterStep = Callable[[object, dict[Sequence, int]], list[EngineCoreOutput]]


@dataclass
class Seams:
    # 1. Requests (EngineCore.check_request, add_request): an option a feature serves -> its check, before anything
    #    is queued (a ValueError names what is wrong); a request setting an option nobody serves is refused
    #    (priority, lora_request, structured_outputs). Then a SamplingParams field -> who sets a request up for it
    #    (structured_outputs: compile the grammar).
    request_checks: dict[str, Callable[[object], None]] = field(default_factory=dict)
    request_options: dict[str, Callable[[Request], None]] = field(default_factory=dict)
    # 2. Admission (Scheduler._next_waiting): (waiting sequence, the scheduler, the plan so far) -> may it join this
    #    step? One that may not keeps its place; those behind it may go (vLLM v0.6.3's curr_loras: LoRA's max_loras).
    admits: list[Callable[[Sequence, object, object], bool]] = field(default_factory=list)
    # 3. Running (Scheduler._schedule_running): (a request's running sequences) -> must they sit this step out?
    #    (async scheduling: a token they need is still in flight.)
    sits_out: list[Callable[[list[Sequence]], bool]] = field(default_factory=list)
    # 4. Sequences that cannot be planned before their newest token is known, with async scheduling (a grammar's
    #    next mask, drafts proposed from that token): the async chapter's sits_out asks these.
    needs_newest_token: list[Callable[[Sequence], bool]] = field(default_factory=list)
    # 7. The plan is made (Scheduler.schedule): hooks that add to it.
    after_schedule: list[Callable[[object], None]] = field(default_factory=list)
    # 8. Sampling (layers/sampler.py): logits processors, applied in order to the rows the sampler draws from
    #    (a grammar's mask of allowed tokens). The InputBuilder asks each for its step's state on the host.
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    # 9. More logits rows (InputBuilder.prepare_inputs), by feature: (plan, sampling rows, the first free logits
    #     row) -> (batch rows whose logits it wants too, its state, kept in ModelInput.extras[name]) (logprobs.py).
    extra_logits_rows: dict[str, Callable] = field(default_factory=dict)
    # 10. Before the forward (Executor.launch), KV moved between pools on every rank: each hook is called with
    #    "out" (copies that read the device pool: swap-outs, offloads), then, after all of them, with "in" (copies
    #    that write it: swap-ins, host-tier hits), since a block the first free may be the second's destination.
    #    (plan, executor, "out" | "in") -> None.
    move_kv: list[Callable[[object, object, str], None]] = field(default_factory=list)
    # 12. Just before the forward, on the process that plans: (plan, inputs) -> None, e.g. async scheduling's
    #    placeholders filled on the device, LoRA's slot loads and rows (run on every rank through
    #    executor.call("apply", fn, ...), ModelRunner.apply).
    before_forward: list[Callable[[object, object], None]] = field(default_factory=list)
    # 14. After drawing (ModelRunner.sample): (model runner, logits, the tokens drawn, inputs) -> None (logprobs).
    after_sample: list[Callable] = field(default_factory=list)
    # 15. The step's output comes back (EngineCore._update_from_output), first: hooks that fail requests the step
    #    left without valid KV. (plan) -> their outputs.
    before_update: list[Callable[[object], list[EngineCoreOutput]]] = field(default_factory=list)
    # 17. After the step, in order: hooks that take the step's tokens in (a grammar accepts
    #    them), or pick tokens themselves (beam search).
    after_step: list[AfterStep] = field(default_factory=list)
    # 18. Observers, last: read each step (step records, the dashboard); None when an abort changed the queues.
    observers: list[Callable[[object | None, list[Sequence]], None]] = field(default_factory=list)
    # The features plugged in, by name ("beam_search", "step_records", ...): one that joins with its first
    # request, or that a front end reads (llm.trace), finds its object here.
    features: dict[str, object] = field(default_factory=dict)

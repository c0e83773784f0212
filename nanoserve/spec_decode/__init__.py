"""Speculative decoding (docs/speculative.md): proposers that guess k tokens ahead into the core's lookahead slots
(Sequence.spec_token_ids), and the verification that keeps what the target model agrees with. The scheduler's
books for the 1 + k tokens are kept by accounting.py's accept_run with the core's BlockManager.truncate; this
chapter plugs in at five seams."""
from nanoserve.engine.core import EngineCore
from nanoserve.spec_decode.accounting import accept_run, waits_for_drafts
from nanoserve.spec_decode.draft_model_proposer import DraftModelProposer
from nanoserve.spec_decode.proposer import propose_drafts
from nanoserve.spec_decode.verify import verify


def plug_in(engine: EngineCore) -> None:
    seams, spec = engine.seams, engine.config.speculative_config
    scheduler = engine.scheduler  # (not the engine: its seams must not hold it, or `del llm` would not free it)
    seams.sample = verify  # the draw: a verification of each request's drafts
    seams.accept_lookahead = accept_run  # the scheduler takes the verified run in, rolls back past the rest
    seams.needs_newest_token.append(waits_for_drafts)  # async scheduling: drafts start from the newest token
    seams.after_step.append(lambda out, updated: propose_drafts(scheduler.running, spec))  # the next step's
    if spec.method == "draft_model":  # before the forward: the draft model fills the slots the scheduler reserved
        # (It rebuilds the step's inputs with the drafts filled in, with the engine's InputBuilder.)
        seams.propose = DraftModelProposer(engine.input_builder).propose

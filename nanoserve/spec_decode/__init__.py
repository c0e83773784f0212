"""Speculative decoding (docs/speculative.md): proposers that guess k tokens ahead into the
lookahead slots (Sequence.spec_token_ids), and the verification that keeps what the target model
agrees with.
A subclass of each core class it changes, each the core's own unless speculative_config is set:
- SpecDecodeScheduler (scheduler.py): proposes the drafts before each plan, records them in its plan
  (SpecDecodeSchedulerOutput), takes the verified run in and rolls back past it;
- SpecDecodeModelRunner (model_runner.py): loads the draft model, verifies instead of a draw;
- SpecDecodeExecutor (model_runner.py): runs the draft model before the target's forward;
- SpecDecodeEngineCore (here): hands that draft pass the engine's InputBuilder.
"""
from nanoserve.config import Config
from nanoserve.engine.core import EngineCore
from nanoserve.spec_decode.draft_model_proposer import DraftModelProposer
from nanoserve.spec_decode.model_runner import (
    SpecDecodeExecutor,
    SpecDecodeInputBuilder,
    SpecDecodeModelInput,
    SpecDecodeModelRunner,
)
from nanoserve.spec_decode.scheduler import SpecDecodeScheduler, SpecDecodeSchedulerOutput

__all__ = ["SpecDecodeEngineCore", "SpecDecodeExecutor", "SpecDecodeInputBuilder",
           "SpecDecodeModelInput", "SpecDecodeModelRunner", "SpecDecodeScheduler",
           "SpecDecodeSchedulerOutput"]


class SpecDecodeEngineCore(EngineCore):
    """The EngineCore whose executor runs a draft model: the draft pass rebuilds the step's inputs
    with the drafts filled in, with this engine's InputBuilder (built after the executor)."""

    def __init__(self, config: Config, **parts):
        super().__init__(config, **parts)
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            self.executor.proposer = DraftModelProposer(self.input_builder)

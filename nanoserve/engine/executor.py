"""The executor (vLLM's name) runs each step on the model: here this process's ModelRunner alone (vLLM's
UniProcExecutor). nanoserve/parallel/executor.py runs the same step on every rank of a tensor- or pipeline-
parallel engine: it overrides `call` (send the call to every worker too) and `finish` (the last stage's logits)."""
import torch

from nanoserve.config import Config
from nanoserve.engine.input_batch import ModelInput
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.seams import Seams
from nanoserve.layers.attention import AttentionMetadata


class Executor:
    def __init__(self, config: Config, seams: Seams):
        self.config, self.seams = config, seams
        self.model_runner = ModelRunner(config, seams=seams)

    def execute_model(self, out: SchedulerOutput, inputs: ModelInput | None) -> torch.Tensor:
        """One step: the KV block copies, the forward, then sampling. Returns a token id per sampling row, as a
        device tensor (no wait for it here)."""
        return self.finish(out, *self.launch(out, inputs))

    def launch(self, out: SchedulerOutput, inputs: ModelInput | None) -> tuple[ModelInput | None, torch.Tensor | None]:
        """The step up to the logits: returns the inputs that ran (with a draft model's drafts) and their logits."""
        for way in ("out", "in"):  # the seam: KV moved between pools (swap, the host tier), reads of the device first
            for move in self.seams.move_kv:
                move(out, self, way)
        if out.blocks_to_copy:  # copy-on-write, inside the device pool
            self.call("copy_blocks", out.blocks_to_copy)
        if self.seams.propose is not None:  # the seam before the forward: a draft model fills the lookahead slots
            inputs = self.seams.propose(out, inputs, self.run_draft)
        if inputs is None:  # everyone was preempted
            return None, None
        for prepare in self.seams.before_forward:  # the seam: e.g. async scheduling's placeholders, LoRA's rows
            prepare(out, inputs)
        return inputs, self.call("run_model", inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows)

    def run_draft(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  rows: torch.Tensor) -> torch.Tensor | None:
        """One forward of the draft model (speculative decoding); its logits of `rows`."""
        return self.call("run_model", input_ids, positions, meta, rows, True)  # draft=True

    def finish(self, out: SchedulerOutput, inputs: ModelInput | None, logits: torch.Tensor | None) -> torch.Tensor:
        """The step's sampled ids from its logits. The rows of requests that pick their own tokens (raw_logits)
        go back with the plan (`out.raw_logits`), nothing drawn."""
        if inputs is None:
            return torch.empty(0, dtype=torch.int64)
        if inputs.raw_rows:
            out.raw_logits = logits[inputs.raw_rows]
        return self.model_runner.sample(logits, inputs)

    def call(self, method: str, *args):
        """model_runner.method(*args) (the parallel executor sends every worker the same call first)."""
        return getattr(self.model_runner, method)(*args)

    def shutdown(self) -> None:
        pass

"""The executor runs each step on the model: here this process's ModelRunner alone (vLLM's UniProcExecutor).
parallel/executor.py runs it on every rank: it overrides `call` (to every worker too) and `finish` (the last
pipeline stage's logits)."""
import torch

from nanoserve.config import Config
from nanoserve.engine.input_batch import ModelInput
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.scheduler_output import SchedulerOutput
from nanoserve.engine.seams import Seams


class Executor:
    def __init__(self, config: Config, seams: Seams):
        self.config, self.seams = config, seams
        self.model_runner = ModelRunner(config, seams=seams)

    def execute_model(self, out: SchedulerOutput, inputs: ModelInput | None) -> torch.Tensor:
        """One step: the KV block copies, the forward, sampling. A token id per sampling row, on the device."""
        return self.finish(out, *self.launch(out, inputs))

    def launch(self, out: SchedulerOutput, inputs: ModelInput | None) -> tuple[ModelInput | None, torch.Tensor | None]:
        """The step up to the logits: the inputs that ran (with a draft model's drafts) and their logits."""
        for way in ("out", "in"):  # the seam: KV moved between pools (swap, the host tier), reads of the device first
            for move in self.seams.move_kv:
                move(out, self, way)
        if out.blocks_to_copy:  # copy-on-write, inside the device pool
            self.call("copy_blocks", out.blocks_to_copy)
        if self.seams.propose is not None:  # the seam before the forward: a draft model fills the lookahead slots
            inputs = self.seams.propose(out, inputs, lambda *args: self.call("run_model", *args, True))  # draft=True
        if inputs is None:  # everyone was preempted
            return None, None
        for prepare in self.seams.before_forward:  # the seam: e.g. async scheduling's placeholders, LoRA's rows
            prepare(out, inputs)
        return inputs, self.call("run_model", inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_rows)

    def finish(self, out: SchedulerOutput, inputs: ModelInput | None, logits: torch.Tensor | None) -> torch.Tensor:
        """The sampled ids."""
        if inputs is None:
            return torch.empty(0, dtype=torch.int64)
        return self.model_runner.sample(logits, inputs)

    def call(self, method: str, *args):
        return getattr(self.model_runner, method)(*args)

    def shutdown(self) -> None:
        pass

"""Disaggregated prefill (vLLM's --kv-transfer-config): one engine computes prompts (the producer,
kv_producer), another receives their KV blocks and generates (the consumer, kv_consumer), and a
proxy sends each request through both (serving/proxy.py). It buys control, not throughput: a long
prompt no longer stalls the decodes of other requests, since they run on another engine
(docs/disaggregated.md).

The connector, P2pConnector (connector.py), has vLLM's KVConnectorBase_V1 methods; the chapter's
subclasses of the core's parts call them where vLLM's scheduler and worker do, each inert unless
config.kv_transfer_config is set. KVTransferEngineCore makes the connector, checks and sets up a
request's kv_transfer_params; KVTransferScheduler holds a consumer's request back until its blocks
came, and puts the step's loads and saves in its plan (a KVTransferSchedulerOutput);
KVTransferBlockManager counts the received KV as computed once a prompt has its blocks;
KVTransferExecutor writes it into the consumer's blocks before the forward; the producer's engine
core copies its prompts' KV out after each step. The KV travels over a torch.distributed group of
the two engines (pipe.py).
"""
from dataclasses import dataclass, field

from nanoserve.config import Config
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import Executor
from nanoserve.engine.output_processor import EngineCoreOutput
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sequence import Request, Sequence
from nanoserve.kv_transfer.connector import ConnectorMetadata, KVTransferStats, P2pConnector

__all__ = ["KVTransferBlockManager", "KVTransferEngineCore", "KVTransferExecutor",
           "KVTransferScheduler", "KVTransferSchedulerOutput", "KVTransferStats", "P2pConnector",
           "remote_prefill_params"]


@dataclass
class KVTransferSchedulerOutput(SchedulerOutput):
    """The plan with the connector's work for the step (vLLM's kv_connector_metadata)."""

    kv_connector_metadata: ConnectorMetadata = field(default_factory=ConnectorMetadata)


class KVTransferBlockManager(BlockManager):
    kv_connector: P2pConnector | None = None  # KVTransferEngineCore's; None: off

    def allocate(self, seq: Sequence, max_new_tokens: int | None = None) -> bool:
        """Once the prompt has its blocks, more of it counts as computed: KV another engine made."""
        if not super().allocate(seq, max_new_tokens):
            return False
        if self.kv_connector is not None:
            self.kv_connector.update_state_after_alloc(seq)
        return True


class KVTransferScheduler(Scheduler):
    output_class = KVTransferSchedulerOutput
    kv_connector: P2pConnector | None = None  # KVTransferEngineCore's; None: off

    def can_admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """A consumer's request waits, keeping its place, until its prompt's KV came."""
        connector = self.kv_connector
        if connector is not None and not connector.has_remote_kvs(seq, idle=not self.running):
            return False
        return super().can_admit(seq, out)

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return out


class KVTransferExecutor(Executor):
    """The connector's worker side: the received KV loaded with the copies that write the device
    pool."""

    kv_connector: P2pConnector | None = None  # KVTransferEngineCore's; None: off

    def copy_kv_in(self, out: KVTransferSchedulerOutput) -> None:
        if self.kv_connector is not None:
            self.kv_connector.start_load_kv(out.kv_connector_metadata)
        super().copy_kv_in(out)


class KVTransferEngineCore(EngineCore):
    """Joins the engine to its peer as its kv_transfer_config says (the peer may come later: a
    thread waits), and hands the connector to the parts that call it."""

    def __init__(self, config: Config, *args, **kwargs):
        if config.kv_transfer_config is not None and config.parallel_config.world_size > 1:
            raise ValueError("kv_transfer_config: needs tensor_parallel_size = "
                             "pipeline_parallel_size = 1 (each rank would have to send its own "
                             "share of the KV)")
        super().__init__(config, *args, **kwargs)
        self.kv_connector: P2pConnector | None = None
        if config.kv_transfer_config is None:
            return
        try:
            self.kv_connector = P2pConnector(self, config.kv_transfer_config)
        except BaseException:
            self.shutdown()
            raise
        self.block_manager.kv_connector = self.scheduler.kv_connector = self.kv_connector
        self.executor.kv_connector = self.kv_connector

    def check_option(self, name: str, value: object) -> None:
        if name == "kv_transfer_params" and self.kv_connector is not None:
            return self.kv_connector.check_request(value)
        super().check_option(name, value)

    def _update_from_output(self, out: KVTransferSchedulerOutput,
                            token_ids: list[int]) -> list[EngineCoreOutput]:
        """A step that succeeded: the producer saves the prompts it completed. (vLLM's worker saves
        at the end of its forward, in its own process; here, once the step's output is in, the host
        never waits for the forward to save.)"""
        outputs = super()._update_from_output(out, token_ids)
        if self.kv_connector is not None:
            self.kv_connector.wait_for_save(out.kv_connector_metadata)
        return outputs

    def add(self, request: Request) -> None:
        """A consumer's request starts pulling its prompt's KV as soon as it is queued."""
        super().add(request)
        if self.kv_connector is not None and request.sampling_params.kv_transfer_params is not None:
            self.kv_connector.add_request(request)


def remote_prefill_params(engine: EngineCore, params: dict | None) -> dict | None:
    """The kv_transfer_params a producer answers a {"do_remote_decode": true} request with, for the
    consumer (vLLM's shape): where its blocks are. None for any other request."""
    if not params or not params.get("do_remote_decode"):
        return None
    config = engine.config.kv_transfer_config
    return {"do_remote_prefill": True, "remote_host": config.kv_ip, "remote_port": config.kv_port}

"""Disaggregated prefill (vLLM's --kv-transfer-config): one engine computes prompts (the producer, kv_producer),
another receives their KV blocks and generates (the consumer, kv_consumer), and a proxy sends each request
through both (serving/proxy.py). It buys control, not throughput: a long prompt no longer stalls the decodes of
other requests, since they run on another engine (docs/disaggregated.md).

It plugs in at the kv_connector seam (engine/seams.py, in vLLM's KVConnectorBase_V1 shape: connector.py), at
request_checks and request_options (a request's kv_transfer_params), admits (a consumer's request waits for its
blocks), after_schedule (the step's loads and saves join its plan), and move_kv and after_step (the KV into the
consumer's blocks before the forward, out of the producer's after the step). The KV
travels over a torch.distributed process group of the two engines (pipe.py).
"""
from nanoserve.engine.core import EngineCore
from nanoserve.kv_transfer.connector import KVTransferStats, P2pConnector

__all__ = ["plug_in", "remote_prefill_params", "KVTransferStats", "P2pConnector"]


def plug_in(engine: EngineCore) -> P2pConnector:
    """Join the engine to its peer as its kv_transfer_config says (the peer may come later: a thread waits)."""
    config = engine.config
    if config.parallel_config.world_size > 1:
        raise ValueError("kv_transfer_config: needs tensor_parallel_size = pipeline_parallel_size = 1 "
                         "(each rank would have to send its own share of the KV)")
    connector = P2pConnector(engine, config.kv_transfer_config)
    engine.seams.kv_connector = connector
    engine.seams.request_checks["kv_transfer_params"] = connector.check_request
    engine.seams.request_options["kv_transfer_params"] = connector.add_request
    engine.seams.admits.append(connector.admits)
    engine.seams.after_schedule.append(connector.build_connector_meta)
    engine.seams.move_kv.append(connector.start_load_kv)
    if config.kv_transfer_config.is_producer:
        engine.seams.after_step.append(connector.wait_for_save)
    engine.seams.features["kv_transfer"] = connector
    return connector


def remote_prefill_params(engine: EngineCore, params: dict | None) -> dict | None:
    """The kv_transfer_params a producer answers a {"do_remote_decode": true} request with, for the consumer (vLLM's
    shape): where its blocks are. None for any other request."""
    if not params or not params.get("do_remote_decode"):
        return None
    config = engine.config.kv_transfer_config
    return {"do_remote_prefill": True, "remote_host": config.kv_ip, "remote_port": config.kv_port}

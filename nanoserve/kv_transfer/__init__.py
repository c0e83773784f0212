"""Disaggregated prefill (vLLM's --kv-transfer-config): one engine computes prompts (the producer, kv_producer),
another receives their KV blocks and generates (the consumer, kv_consumer), and a proxy sends each request
through both (serving/proxy.py). It buys control, not throughput: a long prompt no longer stalls the decodes of
other requests, since they run on another engine (docs/disaggregated.md).

It plugs in at the kv_connector seam (engine/seams.py, in vLLM's KVConnectorBase_V1 shape: connector.py), at
request_options (a request's kv_transfer_params), admits (a consumer's request waits for its blocks), and
before_forward and after_step (the KV into the consumer's blocks, out of the producer's). The KV
travels over a torch.distributed process group of the two engines (pipe.py).
"""
from nanoserve.engine.core import EngineCore
from nanoserve.kv_transfer.connector import KVTransferStats, P2pConnector

__all__ = ["plug_in", "KVTransferStats", "P2pConnector"]


def plug_in(engine: EngineCore) -> P2pConnector:
    """Join the engine to its peer as its kv_transfer_config says (the peer may come later: a thread waits)."""
    config = engine.config
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ValueError("kv_transfer_config: needs tensor_parallel_size = pipeline_parallel_size = 1 "
                         "(each rank would have to send its own share of the KV)")
    connector = P2pConnector(engine, config.kv_transfer_config)
    engine.seams.kv_connector = connector
    engine.seams.request_options["kv_transfer_params"] = connector.add_request
    engine.seams.admits.append(connector.admits)
    engine.seams.before_forward.append(connector.start_load_kv)
    if config.kv_transfer_config.is_producer:
        engine.seams.after_step.append(connector.wait_for_save)
    engine.seams.features["kv_transfer"] = connector
    return connector

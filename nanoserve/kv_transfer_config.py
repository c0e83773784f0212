"""Disaggregated prefill's options, as vLLM spells them:
`LLM(..., kv_transfer_config=KVTransferConfig(...))` and `nanoserve serve --kv-transfer-config JSON`
(docs/disaggregated.md).

A leaf module (no torch), like speculative_config.py, so that config.py can import it.
"""
from dataclasses import dataclass, field

from nanoserve.utils.records import record_from_dict

# nanoserve/kv_transfer/: KV blocks over torch.distributed point-to-point
CONNECTORS = ("P2pConnector",)
ROLES = ("kv_producer", "kv_consumer")
EXTRA_KEYS = ("transfer_timeout",)


@dataclass
class KVTransferConfig:
    """Which connector joins this engine to its peer, and as which side. The producer (the prefill
    instance) computes prompts and keeps their KV blocks for the consumer (the decode instance),
    which pulls them."""

    kv_connector: str | None = None  # "P2pConnector"
    kv_role: str | None = None  # "kv_producer" (prefill) or "kv_consumer" (decode)
    # this engine's rank in the pair: 0 the producer, 1 the consumer (None: from kv_role)
    kv_rank: int | None = None
    kv_parallel_size: int = 2  # engines in the group: a producer and a consumer
    # where the producer hosts the rendezvous (a TCPStore, as torchrun's MASTER_ADDR)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # its port (as torchrun's MASTER_PORT)
    # bytes of KV the producer keeps for the consumer to pull, oldest dropped first
    kv_buffer_size: float = 1e9
    # {"transfer_timeout": seconds (default 10)}
    kv_connector_extra_config: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, options: "dict | KVTransferConfig") -> "KVTransferConfig":
        """What `LLM(..., kv_transfer_config=...)` and `--kv-transfer-config JSON` receive."""
        return record_from_dict(cls, options, "kv_transfer_config")

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {CONNECTORS}, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, "
                             f"got {self.kv_role!r}")
        expected_rank = ROLES.index(self.kv_role)
        if self.kv_rank is None:
            self.kv_rank = expected_rank
        if self.kv_rank != expected_rank:
            raise ValueError(f"kv_transfer_config.kv_rank must be {expected_rank} "
                             f"for {self.kv_role} (the producer is rank 0), got {self.kv_rank!r}")
        if self.kv_parallel_size != 2:
            raise ValueError("kv_transfer_config.kv_parallel_size must be 2 (one producer, one "
                             f"consumer), got {self.kv_parallel_size!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError("kv_transfer_config.kv_ip must be a host name or address, "
                             f"got {self.kv_ip!r}")
        if (isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int)
                or not 1 <= self.kv_port <= 65535):
            raise ValueError("kv_transfer_config.kv_port must be an integer in [1, 65535], "
                             f"got {self.kv_port!r}")
        if (isinstance(self.kv_buffer_size, bool)
                or not isinstance(self.kv_buffer_size, (int, float))
                or not 0 <= self.kv_buffer_size < float("inf")):
            raise ValueError(f"kv_transfer_config.kv_buffer_size must be a number of bytes >= 0, "
                             f"got {self.kv_buffer_size!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict) or set(extra) - set(EXTRA_KEYS):
            raise ValueError("kv_transfer_config.kv_connector_extra_config: the keys "
                             f"are {list(EXTRA_KEYS)}, got {extra!r}")
        timeout = extra.get("transfer_timeout", 10.0)
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not 0 < timeout < float("inf")):
            raise ValueError("kv_transfer_config.kv_connector_extra_config.transfer_timeout must "
                             f"be seconds > 0, got {timeout!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def transfer_timeout(self) -> float:
        """Seconds a consumer waits for a prompt's blocks before it computes the prompt itself."""
        return float(self.kv_connector_extra_config.get("transfer_timeout", 10.0))

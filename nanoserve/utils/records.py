"""What the parameter records (SpeculativeConfig, KVTransferConfig) share: built from the dict a caller gives."""
from dataclasses import fields


def record_from_dict(cls: type, options: object, name: str) -> object:
    """options as a cls: one already, or a dict of its fields (an unknown key is a ValueError naming `name`)."""
    if isinstance(options, cls):
        return options
    if not isinstance(options, dict):
        raise ValueError(f"{name} must be a dict or a {cls.__name__}, got {type(options).__name__}")
    known = [f.name for f in fields(cls)]
    if unknown := sorted(set(options) - set(known)):
        raise ValueError(f"{name}: unknown key(s) {unknown}; the keys are {known}")
    return cls(**options)

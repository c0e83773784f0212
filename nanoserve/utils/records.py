"""What the option records share: built from the dict a caller gives (SpeculativeConfig,
KVTransferConfig), and their values checked against their limits (Config, the chapters' records)."""
import math
from dataclasses import fields
from numbers import Integral


def record_from_dict(cls: type, options: object, name: str) -> object:
    """options as a cls: one already, or a dict of its fields (an unknown key is a ValueError naming
    `name`)."""
    if isinstance(options, cls):
        return options
    if not isinstance(options, dict):
        raise ValueError(f"{name} must be a dict or a {cls.__name__}, got {type(options).__name__}")
    known = [f.name for f in fields(cls)]
    if unknown := sorted(set(options) - set(known)):
        raise ValueError(f"{name}: unknown key(s) {unknown}; the keys are {known}")
    return cls(**options)


def check_limits(record: object, limits: tuple, choices: tuple = (),
                 may_be_none: tuple = ()) -> None:
    """A record's numeric options in their ranges, (name, type, allowed, the limit as the error
    states it), and its options with choices among theirs, (name, choices), as SamplingParams checks
    its own. A float must be finite too: NaN fails every comparison, but inf passes ">= 0". Names in
    may_be_none may also be None."""
    for name, kind, allowed, limit in limits:
        value = getattr(record, name)
        if value is None and name in may_be_none:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            kind_name = "an integer" if kind is Integral else "a number"
            raise ValueError(f"{name} must be {kind_name}, got {value!r}")
        if not math.isfinite(value) or not allowed(value):
            raise ValueError(f"{name} must be {limit}, got {value}")
    for name, allowed in choices:
        if getattr(record, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(record, name)!r}")

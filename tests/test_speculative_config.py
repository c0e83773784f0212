"""SpeculativeConfig: vLLM's keys and defaults; every bad value is a ValueError naming its field."""
import pytest

from nanoserve.speculative_config import SpeculativeConfig


def test_ngram_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.model, c.disable_by_batch_size) == (5, 5, None, None)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 7})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (1, 1, 7)


def test_draft_model_and_method_inferred_from_model():
    c = SpeculativeConfig.from_dict({"model": "/models/draft", "num_speculative_tokens": 4})
    assert (c.method, c.model, c.prompt_lookup_min) == ("draft_model", "/models/draft", None)
    assert SpeculativeConfig.from_dict(c) is c  # an object passes through


def test_disable_by_batch_size():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4})
    assert [c.enabled_for(n) for n in (1, 4, 5, 100)] == [True, True, False, False]
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).enabled_for(10_000)


@pytest.mark.parametrize("options, field", [
    ([("method", "ngram")], "speculative_config must be a dict"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup": 3}, "unknown key(s) ['prompt_lookup']"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 10**9}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": float("nan")}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": float("inf")}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (3)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/draft"}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2.5}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": 3}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/d", "prompt_lookup_max": 3},
     "prompt_lookup_max"),
])
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match="speculative_config") as error:
        SpeculativeConfig.from_dict(options)
    assert field in str(error.value)


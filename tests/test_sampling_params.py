import math

import pytest

from tokenmill.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 0}, "n"), ({"n": -1}, "n"), ({"n": 10**9}, "n"), ({"n": 1.5}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"seed": 2**63}, "seed"), ({"seed": "x"}, "seed"),
    ({"logprobs": -1}, "logprobs"), ({"logprobs": 10**6}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stop": ["x"] * 1000}, "stop"), ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"), ({"logit_bias": {5: 500.0}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
])
def test_invalid_values_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(stop="END", logit_bias={"7": 2})
    assert p.stop == ["END"] and p.logit_bias == {7: 2.0} and p.stop_token_ids == []
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy


def test_engine_stops_include_eos_unless_ignored():
    assert SamplingParams(stop_token_ids=[5]).with_engine_stops(2).all_stop_token_ids == {2, 5}
    assert SamplingParams(ignore_eos=True).with_engine_stops(2).all_stop_token_ids == set()


def test_vocab_checks():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).check_token_ids(100)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).check_token_ids(100)
    SamplingParams(stop_token_ids=[99]).check_token_ids(100)

"""At temperature 1, every output of a random model follows its constraint: >= 200 generated
JSON schemas (validated with jsonschema), regexes (re.fullmatch) and choice lists. Hypothesis
draws the constraints (seeded, generate phase only); each family is then generated in one
batch, so the test costs a few engine runs, not one per example."""
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.structured.strategies import CHOICES, json_schemas, regexes
from tokenmill import SamplingParams

NUM_SCHEMAS = 200


def draw_examples(strategy, count: int) -> list:
    """``count`` distinct values of ``strategy``, explored as hypothesis explores a test."""
    seen = {}

    @settings(max_examples=count * 3, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value):
        if len(seen) < count:
            seen.setdefault(json.dumps(value), value)

    collect()
    assert len(seen) == count, f"hypothesis found only {len(seen)} distinct values"
    return list(seen.values())


def generate(llm, constraints: list[dict], max_tokens: int = 1500):
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens,
                             structured_outputs=c) for i, c in enumerate(constraints)]
    prompts = [f"Answer {i}:" for i in range(len(constraints))]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_generated_json_schemas_are_always_satisfied(tiny_llm):
    schemas = draw_examples(json_schemas(), NUM_SCHEMAS)
    for schema, out in zip(schemas, generate(tiny_llm, [{"json": s} for s in schemas])):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_generated_regexes_and_choices_are_always_satisfied(tiny_llm):
    patterns, choice_lists = draw_examples(regexes(), 60), draw_examples(CHOICES, 60)
    constraints = [{"regex": p} for p in patterns] + [{"choice": c} for c in choice_lists]
    outputs = generate(tiny_llm, constraints, max_tokens=200)
    for pattern, out in zip(patterns, outputs):
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), (pattern, out.text)
    for choices, out in zip(choice_lists, outputs[len(patterns):]):
        assert out.text in choices, (choices, out.text)

"""Runner request state: any token range of prompt + output + this step's drafts."""
import random

from tokenmill.runner.input_builder import RunnerRequestState


def test_tokens_slices_prompt_output_and_drafts():
    rng = random.Random(0)
    for _ in range(2000):
        prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 8))]
        output = [rng.randrange(100) for _ in range(rng.randrange(0, 6))]
        drafts = [rng.randrange(100) for _ in range(rng.randrange(0, 4))]
        state = RunnerRequestState("r", prompt, output, None, [], 0, None, None, drafts)
        full = prompt + output + drafts
        start = rng.randrange(0, len(full))
        end = rng.randrange(start, len(full) + 1)
        assert state.tokens(start, end) == full[start:end], (prompt, output, drafts, start, end)

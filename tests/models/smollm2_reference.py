"""HF transformers (float32, loading the same GGUF) as the oracle for SmolLM2-135M.

Loading it costs ~20 s, so its outputs are stored in tests/data/smollm2_reference.json;
`python -m tests.models.smollm2_reference` regenerates the file, and a slow test recomputes
one prompt live to prove the stored file still matches HF."""
import json
import os
import sys

import torch

REFERENCE_PATH = os.path.join(os.path.dirname(__file__), "..", "data", "smollm2_reference.json")
NUM_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nGive me three tips for staying healthy.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]


def load_hf(gguf_path):
    import transformers
    directory, name = os.path.split(gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model, tok


def hf_continuation(model, prompt_ids, num_tokens=NUM_TOKENS):
    """Greedy tokens and the logprob of each under HF, one forward per token (no KV cache
    tricks, the plainest possible reference)."""
    ids = list(prompt_ids)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(torch.argmax(lp))
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            ids.append(tok)
    return tokens, logprobs


def main():
    from tokenmill.models.hub import resolve_model
    path = resolve_model("smollm2-135m")
    model, tok = load_hf(path)
    entries = []
    for prompt in PROMPTS:
        prompt_ids = tok(prompt, add_special_tokens=True)["input_ids"]
        tokens, logprobs = hf_continuation(model, prompt_ids)
        entries.append({"prompt": prompt, "prompt_token_ids": prompt_ids,
                        "token_ids": tokens, "logprobs": logprobs})
        print(prompt[:40].replace("\n", " "), "->", tok.decode(tokens)[:60].replace("\n", " "), file=sys.stderr)
    with open(REFERENCE_PATH, "w") as f:
        json.dump({"model": "smollm2-135m", "transformers_dtype": "float32", "entries": entries}, f, indent=1)


if __name__ == "__main__":
    main()

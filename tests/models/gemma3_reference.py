"""HF transformers (float32, loading the same GGUF) as the oracle for Gemma3-270M.

Loading its model and GGUF tokenizer costs minutes, so its outputs are stored in
tests/data/gemma3_reference.json; `python -m tests.models.gemma3_reference` regenerates
the file (greedy continuations, per-token logprobs and tokenizations)."""
import json
import os
import sys

import torch

from tests.models.smollm2_reference import load_hf

REFERENCE_PATH = os.path.join(os.path.dirname(__file__), "..", "data", "gemma3_reference.json")
NUM_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which",
    "Here is a list of the planets in our solar system:\n1.",
    "<start_of_turn>user\nWhat is 12 times 7?<end_of_turn>\n<start_of_turn>model\n",
]
TEXTS = [
    "Hello, world!", "", " ", "   leading and trailing   ", "\n\n\tTabs\tand\nnewlines\r\n",
    "The quick brown fox jumps over the lazy dog.", "naïve café — déjà vu, Straße, Ångström",
    "日本語のテキストと中文字符", "emoji 🙂🚀👩‍👩‍👧 mix", "def f(x):\n    return x ** 2  # square\n",
    "12345 67890 3.14159 1e-10 0xFF", "<start_of_turn>user\nhi<end_of_turn>\n", "<bos><eos><pad>",
    "  two  spaces   three", "I'm sure they'll say it's fine, won't they?", "a" * 50,
    "\u0000\u0001 control \u007f", "ﬁ ligature Ⅻ", "<unused5> <mask>", "[multimodal]x",
]


def hf_continuation(model, prompt_ids, num_tokens=NUM_TOKENS):
    """Greedy tokens and their logprobs from HF ``generate`` (KV cache on: with a 262k
    vocabulary, recomputing every position's logits each step takes many minutes)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[tok]) for step, tok in zip(out.logits, tokens)]
    return tokens, logprobs


def main():
    from tokenmill.models.hub import resolve_model
    path = resolve_model("gemma3-270m")
    model, tok = load_hf(path)
    entries = []
    for prompt in PROMPTS:
        prompt_ids = tok(prompt, add_special_tokens=True)["input_ids"]
        tokens, logprobs = hf_continuation(model, prompt_ids, NUM_TOKENS)
        entries.append({"prompt": prompt, "prompt_token_ids": prompt_ids,
                        "token_ids": tokens, "logprobs": logprobs})
        print(prompt[:40].replace("\n", " "), "->", tok.decode(tokens)[:60].replace("\n", " "), file=sys.stderr)
    texts = []
    for text in TEXTS:
        ids = tok.encode(text)
        texts.append({"text": text, "ids": ids, "tokens": tok.convert_ids_to_tokens(ids),
                      "decoded": tok.decode(ids, skip_special_tokens=True), "decoded_special": tok.decode(ids)})
    with open(REFERENCE_PATH, "w") as f:
        json.dump({"model": "gemma3-270m", "transformers_dtype": "float32", "vocab_size": len(tok),
                   "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                   "chat_template": tok.chat_template, "entries": entries, "texts": texts}, f, indent=1)


if __name__ == "__main__":
    main()

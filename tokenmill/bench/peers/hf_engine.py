"""HF transformers ``generate`` in float32 on the same weights: a GGUF is loaded with
``from_pretrained(dir, gguf_file=...)``, which dequantizes every tensor to plain float layers
(the numerical reference tokenmill's tests use); a directory loads as usual.

Batch-1 times come from a streamer (the time each new token arrives). Offline throughput runs
``generate`` on up to ``max_num_seqs`` left-padded prompts at a time (static batches: that is
how ``generate`` batches). EOS never stops generation: ``eos_token_id`` is cleared on the
generation config, so nothing is masked either."""
from __future__ import annotations

import copy
import os
import time


class _Clock:
    """A ``generate`` streamer that only records when tokens arrive (the first ``put`` is the
    prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value) -> None:
        if self.seen_prompt:
            self.times.append(time.perf_counter())
        self.seen_prompt = True

    def end(self) -> None:
        pass


class HFEngine:
    def __init__(self, spec: dict) -> None:
        import torch
        import transformers
        if spec["precision"] != "fp32":
            raise ValueError("the transformers peer runs fp32 only")
        torch.set_num_threads(spec["num_threads"])
        self.torch = torch
        path = spec["model_path"]
        if path.endswith(".gguf"):
            directory, name = os.path.split(path)
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=name, dtype=torch.float32)
        else:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.eval()
        cfg = copy.deepcopy(self.model.generation_config)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        cfg.eos_token_id = None                  # generate exactly max_new_tokens
        cfg.pad_token_id = pad
        cfg.do_sample, cfg.temperature, cfg.top_p, cfg.top_k = False, None, None, None
        cfg.min_new_tokens = None
        self.gen_config = cfg
        self.max_batch = spec["max_num_seqs"]
        self.info = {"version": transformers.__version__, "threads": torch.get_num_threads(),
                     "weights": os.path.basename(path.rstrip("/")),
                     "dtype": "float32", "batching": f"static, up to {self.max_batch} per generate"}

    def _generate(self, input_ids, attention_mask, max_tokens: int, streamer=None):
        self.gen_config.max_new_tokens = max_tokens
        with self.torch.inference_mode():
            return self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                       generation_config=self.gen_config, streamer=streamer)

    def single(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        ids = self.torch.tensor([prompt])
        clock = _Clock()
        t0 = time.perf_counter()
        out = self._generate(ids, self.torch.ones_like(ids), max_tokens, clock)
        total = time.perf_counter() - t0
        return out[0, len(prompt):].tolist(), clock.times[0] - t0, total

    def batch(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        results = []
        pad = self.gen_config.pad_token_id
        for start in range(0, len(prompts), self.max_batch):
            chunk = prompts[start:start + self.max_batch]
            width = max(len(p) for p in chunk)
            ids = self.torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = self.torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = self._generate(ids, mask, max_tokens)
            results += out[:, width:].tolist()
        return results

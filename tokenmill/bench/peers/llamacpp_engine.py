"""llama.cpp through ``llama-cpp-python``'s low-level API (its ``Llama`` class decodes one
sequence; parallel sequences need ``llama_batch``).

Precision "gguf" loads the model's own GGUF file (e.g. Q4_1); "fp32" loads an F32 copy of it
(``gguf_f32.py``) for the like-for-like row. The KV cache stays llama.cpp's default (f16).

Offline throughput is continuous batching across ``n_seq`` sequence slots, as llama.cpp's
``parallel`` example does: every ``llama_decode`` carries one token of each decoding sequence
plus prompt tokens of newly started ones (up to ``n_batch``); a finished sequence's KV is
removed and the next prompt takes its slot. Without a unified KV cache llama.cpp splits the
context evenly across sequences, so ``n_ctx = n_seq x (longest prompt + max_tokens)``.
Greedy = argmax of the logits (EOS does not stop a sequence).
"""
from __future__ import annotations

import os
import time
from collections import deque


class _Seq:
    def __init__(self, index: int, prompt: list[int]) -> None:
        self.index, self.prompt = index, prompt
        self.num_fed = 0          # prompt tokens sent so far
        self.out: list[int] = []
        self.row = None           # batch row whose logits are this sequence's next token


class LlamaCppEngine:
    def __init__(self, spec: dict) -> None:
        import llama_cpp
        import numpy as np
        self.lc, self.np = llama_cpp, np
        if spec["precision"] not in ("fp32", "gguf"):
            raise ValueError(f"llama.cpp precision must be fp32 or gguf, got {spec['precision']!r}")
        path = spec["weights_path"]
        self._log_cb = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(self._log_cb, None)          # keep llama.cpp quiet
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(),
                                                          llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.threads = spec["num_threads"]
        self.max_seq_len = spec["max_seq_len"]
        self.n_seq = spec["max_num_seqs"]
        self.n_batch = max(512, spec["prefill_len"] + 1)
        self.info = {"version": getattr(llama_cpp, "__version__", "?"), "threads": self.threads,
                     "weights": os.path.basename(path),
                     "weight_bytes": llama_cpp.llama_model_size(self.model),
                     "dtype": "float32" if spec["precision"] == "fp32" else "gguf blocks",
                     "kv_cache": "f16", "batching": f"continuous, {self.n_seq} sequence slots",
                     "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
        self._ctx = {}

    def _context(self, n_seq: int):
        """One context per slot count, made on first use and kept (like a server would)."""
        if n_seq not in self._ctx:
            lc = self.lc
            p = lc.llama_context_default_params()
            p.n_ctx = n_seq * self.max_seq_len
            p.n_batch = self.n_batch
            p.n_ubatch = min(512, self.n_batch)
            p.n_seq_max = n_seq
            p.n_threads = p.n_threads_batch = self.threads
            p.no_perf = True
            ctx = lc.llama_init_from_model(self.model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {p.n_ctx} tokens")
            self._ctx[n_seq] = (ctx, lc.llama_batch_init(self.n_batch, 0, 1))
        return self._ctx[n_seq]

    def single(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        t0 = time.perf_counter()
        outs, first = self._run([prompt], max_tokens, 1)
        return outs[0], first - t0, time.perf_counter() - t0

    def batch(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self._run(prompts, max_tokens, self.n_seq)[0]

    def _run(self, prompts: list[list[int]], max_tokens: int, n_seq: int):
        """Continuous batching over ``n_seq`` slots; returns outputs and the time the first
        token of any sequence was sampled."""
        lc = self.lc
        ctx, batch = self._context(n_seq)
        mem = lc.llama_get_memory(ctx)
        lc.llama_memory_clear(mem, True)
        queue = deque(enumerate(prompts))
        slots: list = [None] * n_seq
        outputs: list = [None] * len(prompts)
        first_time = None
        while queue or any(slots):
            for s in range(n_seq):
                if slots[s] is None and queue:
                    slots[s] = _Seq(*queue.popleft())
            self._fill(batch, slots)
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} (KV cache full or bad batch)")
            for s, seq in enumerate(slots):
                if seq is None or seq.row is None:
                    continue
                logits = self.np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, seq.row),
                                                    shape=(self.n_vocab,))
                seq.out.append(int(logits.argmax()))
                seq.row = None
                if first_time is None:
                    first_time = time.perf_counter()
                if len(seq.out) >= max_tokens:
                    outputs[seq.index] = seq.out
                    lc.llama_memory_seq_rm(mem, s, -1, -1)
                    slots[s] = None
        return outputs, first_time

    def _fill(self, batch, slots: list) -> None:
        """One decode token per decoding sequence, then prompt tokens while room is left."""
        n = 0

        def add(token: int, pos: int, seq_id: int, logits: bool) -> None:
            nonlocal n
            batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
            batch.seq_id[n][0] = seq_id
            batch.logits[n] = logits
            n += 1

        for s, seq in enumerate(slots):
            if seq is not None and seq.num_fed == len(seq.prompt):
                seq.row = n
                add(seq.out[-1], len(seq.prompt) + len(seq.out) - 1, s, True)
        for s, seq in enumerate(slots):
            if seq is None or seq.num_fed == len(seq.prompt):
                continue
            take = min(len(seq.prompt) - seq.num_fed, self.n_batch - n)
            for j in range(seq.num_fed, seq.num_fed + take):
                add(seq.prompt[j], j, s, j == len(seq.prompt) - 1)
            seq.num_fed += take
            if seq.num_fed == len(seq.prompt):
                seq.row = n - 1
            if n >= self.n_batch:
                break
        batch.n_tokens = n

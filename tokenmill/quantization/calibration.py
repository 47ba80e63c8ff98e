"""Calibration: ShareGPT text (the calibration split only) run through the float model,
with each Linear's inputs summarised by forward hooks: a GPTQ Hessian, and a row sample for
AWQ's searches. Keys are the engine's module names (fused: ``...qkv_proj``)."""
from __future__ import annotations

from typing import Optional

import torch

from tokenmill.quantization.gptq import HessianAccumulator


def text_token_windows(tokenizer, split: str, num_windows: int, seq_len: int,
                       cache_dir: Optional[str] = None) -> list[list[int]]:
    """``num_windows`` windows of ``seq_len`` tokens from one ShareGPT split, conversations
    joined in file order (each turn's text, blank-line separated)."""
    from tokenmill.data.sharegpt import conversations
    stream: list[int] = []
    need = num_windows * seq_len
    for conv in conversations(split, cache_dir):
        stream.extend(tokenizer.encode("\n\n".join(t["content"] for t in conv) + "\n\n",
                                       add_special_tokens=False))
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise ValueError(f"the {split} split holds {len(stream)} tokens, {need} needed")
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(num_windows)]


class InputStats:
    """Per-Linear input statistics gathered while the float model runs."""

    def __init__(self, model: torch.nn.Module, hessian: bool, sample_rows: int,
                 total_rows: int) -> None:
        from tokenmill.layers.linear import Linear
        self.hessians: dict[str, HessianAccumulator] = {}
        self.samples: dict[str, list[torch.Tensor]] = {}
        self.stride = max(1, total_rows // max(sample_rows, 1))
        self._handles = []
        for name, module in model.named_modules():
            if isinstance(module, Linear) and not name.endswith("lm_head"):
                self._handles.append(module.register_forward_pre_hook(self._hook(name, hessian, sample_rows)))

    def _hook(self, name: str, hessian: bool, sample_rows: int):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            if hessian:
                self.hessians.setdefault(name, HessianAccumulator(x.shape[1])).add(x)
            if sample_rows:
                self.samples.setdefault(name, []).append(x[::self.stride].clone())
        return hook

    def sample(self, name: str) -> torch.Tensor:
        return torch.cat(self.samples[name])

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def collect(engine, windows: list[list[int]], hessian: bool, sample_rows: int) -> InputStats:
    """Prefill every window once (one generated token each) with hooks on the Linears."""
    from tokenmill.sampling_params import SamplingParams
    stats = InputStats(engine.model, hessian, sample_rows, sum(len(w) for w in windows))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    try:
        for ids in windows:
            engine.add_request(None, {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        stats.close()
    return stats

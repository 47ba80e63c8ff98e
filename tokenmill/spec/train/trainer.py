"""The training loop every drafter recipe shares: AdamW with warm-up and cosine decay,
gradient clipping, a progress bar, a loss log, held-out acceptance curves, resumable
checkpoints (safetensors + JSON, no pickle) and PNG curves.

A recipe (tokenmill/spec/train/recipes.py lists them) provides ``aux_layers(target)``,
``build(target, options, seed, data)``, ``loss(drafter, target, batch)``,
``acceptance(drafter, target, seqs, k)`` and ``save(drafter, target, out_dir)``.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from tokenmill.spec.train.data import TrainSequence


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch_sequences: int = 8
    lr: float = 1e-3
    warmup: int = 30
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_sequences: int = 24
    checkpoint_every: int = 100
    k: int = 6                       # positions the held-out acceptance is measured at
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_sequences", "eval_every", "checkpoint_every", "k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")


def tau_of(acceptance: list[float]) -> float:
    """Mean tokens per target forward from per-position acceptance (position j accepted
    means every earlier one was): 1 (the target's own token) + the expected accepted drafts."""
    return 1.0 + float(sum(acceptance))


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


class Trainer:
    def __init__(self, recipe, target, train: list[TrainSequence], heldout: list[TrainSequence],
                 cfg: TrainConfig, out_dir: str, progress: bool = True) -> None:
        if not train:
            raise ValueError("no training sequences")
        self.recipe, self.target, self.cfg, self.out_dir = recipe, target, cfg, out_dir
        self.train, self.heldout = train, heldout[:cfg.eval_sequences]
        self.progress = progress
        for p in target.parameters():
            p.requires_grad_(False)
        torch.manual_seed(cfg.seed)
        self.drafter = recipe.build(target, dict(cfg.options), cfg.seed, train)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{recipe.method}: the drafter has no trainable parameters")
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.log: list[dict] = []
        self.evals: list[dict] = []
        self.seconds = 0.0

    # -- loop ---------------------------------------------------------------------------------
    def run(self) -> dict:
        from tqdm import tqdm
        self._resume()
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc=f"train {self.recipe.method}",
                   disable=not self.progress)
        while self.step < self.cfg.steps:
            t0 = time.perf_counter()
            metrics = self._train_step()
            self.seconds += time.perf_counter() - t0
            self.step += 1
            self.log.append({"step": self.step, "seconds": round(self.seconds, 2), **metrics})
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics.get('acc', 0):.2f}")
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                self._evaluate()
            if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                self._checkpoint()
        bar.close()
        self.recipe.save(self.drafter, self.target, self.out_dir)
        self._plot()
        return self.summary()

    def _train_step(self) -> dict:
        self.drafter.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        # Every random choice of a step (the batch, the recipe's positions and masks) is
        # seeded by (seed, step): a resumed run takes exactly the steps it would have.
        step_seed = self.cfg.seed * 1_000_003 + self.step
        random.seed(step_seed)
        torch.manual_seed(step_seed)
        batch = random.Random(step_seed).sample(self.train, min(self.cfg.batch_sequences, len(self.train)))
        loss, metrics = self.recipe.loss(self.drafter, self.target, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{self.recipe.method}: loss became {loss.item()} at step "
                                     f"{self.step}; lower --lr")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.clip)
        self.optimizer.step()
        return {k: round(float(v), 5) for k, v in metrics.items()} | {"lr": lr_at(self.step, self.cfg)}

    def _evaluate(self) -> None:
        if not self.heldout:
            return
        self.drafter.eval()
        with torch.no_grad():
            acc = self.recipe.acceptance(self.drafter, self.target, self.heldout, self.cfg.k)
        self.evals.append({"step": self.step, "acceptance": [round(a, 4) for a in acc],
                           "tau": round(tau_of(acc), 4)})

    def summary(self) -> dict:
        last = self.evals[-1] if self.evals else {}
        return {"method": self.recipe.method, "steps": self.step,
                "train_seconds": round(self.seconds, 1),
                "final_loss": self.log[-1]["loss"] if self.log else None,
                "heldout_acceptance": last.get("acceptance"), "heldout_tau": last.get("tau"),
                "config": asdict(self.cfg)}

    # -- checkpoints ----------------------------------------------------------------------------
    def _ckpt_dir(self) -> str:
        return os.path.join(self.out_dir, "checkpoint")

    def _checkpoint(self) -> None:
        from safetensors.torch import save_file
        folder = self._ckpt_dir()
        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.drafter.state_dict().items()},
                  os.path.join(folder, "drafter.safetensors.tmp"))
        state = self.optimizer.state_dict()
        flat = {f"{i}.{name}": t.contiguous() for i, s in state["state"].items()
                for name, t in s.items() if isinstance(t, torch.Tensor)}
        save_file(flat, os.path.join(folder, "optimizer.safetensors.tmp"))
        facts = {"step": self.step, "seconds": self.seconds, "log": self.log, "evals": self.evals,
                 "config": asdict(self.cfg),
                 "method": self.recipe.method}
        with open(os.path.join(folder, "trainer.json.tmp"), "w") as f:
            json.dump(facts, f)
        for name in ("drafter.safetensors", "optimizer.safetensors", "trainer.json"):
            os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))
        with open(os.path.join(self.out_dir, "training_log.json"), "w") as f:
            json.dump({"log": self.log, "evals": self.evals}, f)

    def _resume(self) -> None:
        from safetensors.torch import load_file
        folder = self._ckpt_dir()
        path = os.path.join(folder, "trainer.json")
        if not os.path.isfile(path):
            return
        with open(path) as f:
            facts = json.load(f)
        if facts.get("method") != self.recipe.method or \
                _run_defining(facts.get("config") or {}) != _run_defining(_jsonable(asdict(self.cfg))):
            raise ValueError(f"{folder} holds a checkpoint of another run ({facts.get('method')}, "
                             f"{facts.get('config')}); use a new --output or the same settings "
                             f"(only --steps and --eval-every may change, to extend a run)")
        self.drafter.load_state_dict(load_file(os.path.join(folder, "drafter.safetensors")))
        flat = load_file(os.path.join(folder, "optimizer.safetensors"))
        state = self.optimizer.state_dict()
        for key, t in flat.items():
            index, name = key.split(".", 1)
            state["state"].setdefault(int(index), {})[name] = t
        self.optimizer.load_state_dict(state)
        self.step, self.seconds = facts["step"], facts["seconds"]
        self.log, self.evals = facts["log"], facts["evals"]

    # -- curves ---------------------------------------------------------------------------------
    def _plot(self) -> Optional[str]:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        steps = [r["step"] for r in self.log]
        ax1.plot(steps, [r["loss"] for r in self.log], lw=0.8)
        ax1.set(xlabel="step", ylabel="training loss", title=f"{self.recipe.method}: loss")
        for j in range(len(self.evals[-1]["acceptance"]) if self.evals else 0):
            ax2.plot([e["step"] for e in self.evals], [e["acceptance"][j] for e in self.evals],
                     marker="o", label=f"draft {j + 1}")
        ax2.set(xlabel="step", ylabel="P(accepted through position)", ylim=(0, 1),
                title="held-out greedy acceptance")
        if self.evals:
            ax2.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(self.out_dir, "training_curves.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return path


# Settings a resumed run may change: how long it goes and how often it measures.
_EXTENDABLE = ("steps", "eval_every", "checkpoint_every")


def _run_defining(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _EXTENDABLE}


def _jsonable(value):
    return json.loads(json.dumps(value))


"""Self-distillation data for drafters: the target's own continuations of ShareGPT prompts
(calibration split only; `bench spec` measures on the benchmark split), and the target's
hidden states over prompt + continuation, both cached on disk.

A data directory holds passes over the same prompts: pass 0 greedy, passes 1.. sampled at a
temperature with per-prompt seeds (more contexts from the same prompts; the recipes' soft
labels are the target's distribution at every position, so a sampled token is context, not
a label the drafter must copy). Files of pass 0 (pass i > 0 adds ``-sampled-<i>``):
- ``continuations.json``: {"model", "num_prompts", "max_tokens", "seed", ..., "sequences":
  [{"prompt": [ids], "output": [ids]}]} — generated once by tokenmill in batch;
- ``features-<layers>/``: ``aux.npy`` float16 [total, len(layers) * hidden] (the outputs of
  those decoder layers, tokenmill.spec.draft_input numbering), ``final.npy`` float16
  [total, hidden] (after the final norm), ``offsets.npy`` int64 [num_sequences + 1], ``done``
  ({"digest" of the token ids they came from, "seconds" the target run took}). A method
  that reads no layer links ``final.npy`` from another folder of the pass instead of running
  the target again.
A sequence's rows are positions 0..N-1 of prompt + continuation; row p is computed from
tokens 0..p. A pass is recomputed when its facts differ from the request.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class TrainSequence:
    token_ids: torch.Tensor     # [N] int64: prompt + the target's continuation
    prompt_len: int             # the continuation starts here
    aux: torch.Tensor           # [N, len(layers) * hidden] float32
    final: torch.Tensor         # [N, hidden] float32, the target's post-norm hidden states
    prompt_index: int = -1      # which prompt of the data directory (-1: not from one)
    sampled: bool = False       # the continuation was sampled, not greedy

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def calibration_prompts(tokenizer, num: int, max_prompt_tokens: int, seed: int,
                        cache_dir: Optional[str] = None, turns: str = "first") -> list[list[int]]:
    """Chat-templated user turns of ShareGPT's calibration split (conversations shuffled by
    ``seed``), each at most ``max_prompt_tokens`` tokens. ``turns="first"``: opening turns
    only; ``"all"``: the opening turns, then every later user turn, each standing alone as an
    opening turn (the split has ~1100 conversations but ~3500 user turns)."""
    from tokenmill.data.sharegpt import conversations
    if turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {turns!r}")
    convs = conversations("calibration", cache_dir)
    random.Random(seed).shuffle(convs)
    later = [m for conv in convs for m in conv[1:] if m["role"] == "user"] if turns == "all" else []
    prompts = []
    for message in [conv[0] for conv in convs] + later:
        text = message["content"].strip()
        if not text:
            continue
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if len(ids) <= max_prompt_tokens:
            prompts.append(list(ids))
        if len(prompts) == num:
            break
    return prompts


def generate_continuations(llm, prompts: list[list[int]], max_tokens: int,
                           temperature: float = 0.0, seed: int = 0) -> list[dict]:
    """The target's continuations (stopping at its end-of-sequence token): greedy, or sampled
    at ``temperature`` with prompt j seeded ``seed + j``."""
    from tokenmill import SamplingParams
    if temperature == 0:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    else:
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + j)
                  for j in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    return [{"prompt": p, "output": list(o.outputs[0].token_ids)} for p, o in zip(prompts, outs)]


@torch.inference_mode()
def extract_features(runner, sequences: list[list[int]], layers: tuple[int, ...],
                     max_batch_tokens: int = 2048):
    """Yields (aux [N, len(layers) * hidden], final [N, hidden]) per sequence: the target run
    over the whole sequence as one prefill, through the model's modules, with a private
    cache (the runner's own cache and requests are not touched)."""
    from tokenmill.runner.kv_tensors import allocate_kv_caches
    from tokenmill.spec.draft_input import AuxCapture
    model, backend, bs = runner.model, runner.backend, runner.block_size
    a = model.args
    batch: list[list[int]] = []
    for seq in sequences + [None]:
        if seq is not None and (not batch or sum(map(len, batch)) + len(seq) <= max_batch_tokens):
            batch.append(seq)
            continue
        lens = [len(s) for s in batch]
        blocks = [-(-n // bs) for n in lens]
        caches = allocate_kv_caches(a.num_hidden_layers, sum(blocks), bs, model.num_kv_heads,
                                    a.head_dim, torch.float32, runner.device)
        firsts = np.cumsum([0] + blocks)
        tables = [list(range(int(f), int(f) + b)) for f, b in zip(firsts, blocks)]
        meta = backend.build_metadata(lens, lens, tables, bs, runner.device)
        ids = torch.tensor([t for s in batch for t in s], dtype=torch.int64)
        positions = torch.tensor([p for n in lens for p in range(n)], dtype=torch.int64)
        capture = AuxCapture(layers) if layers else None
        final = model(ids, positions, caches, meta, backend, aux=capture).float()
        aux = capture.concat() if layers else final.new_zeros(final.shape[0], 0)
        start = 0
        for n in lens:
            yield aux[start:start + n], final[start:start + n]
            start += n
        batch = [seq] if seq is not None else []


def _pass_suffix(index: int) -> str:
    return f"-sampled-{index}" if index else ""


def _continuations_path(data_dir: str, index: int) -> str:
    return os.path.join(data_dir, f"continuations{_pass_suffix(index)}.json")


def _features_folder(data_dir: str, layers, index: int) -> str:
    return os.path.join(data_dir, "features-" + "-".join(str(x) for x in layers) + _pass_suffix(index))


def _tokens_digest(seqs: list[dict]) -> str:
    """Names the exact token ids a features folder was computed from (a pass regenerated with
    the same lengths has the same offsets, not the same tokens)."""
    h = hashlib.sha256()
    for s in seqs:
        h.update(np.asarray(s["prompt"] + s["output"], dtype=np.int64).tobytes())
    return h.hexdigest()


def _done_facts(folder: str) -> Optional[dict]:
    """What a finished folder's ``done`` records ({"digest", "seconds", ...}); {} for an empty
    one (written before the facts existed), None when unfinished."""
    done = os.path.join(folder, "done")
    if not os.path.isfile(done):
        return None
    with open(done) as f:
        text = f.read().strip()
    return json.loads(text) if text else {}


def _finish(folder: str, digest: str, seconds: Optional[float], **more) -> None:
    with open(os.path.join(folder, "done"), "w") as f:
        json.dump({"digest": digest, "seconds": None if seconds is None else round(seconds, 1),
                   **more}, f)


def _is_current(folder: str, offsets: np.ndarray, digest: str) -> bool:
    """Finished for these tokens. A ``done`` from before the digest existed is trusted on its
    offsets alone."""
    facts = _done_facts(folder)
    if facts is None or not np.array_equal(np.load(os.path.join(folder, "offsets.npy")), offsets):
        return False
    return facts.get("digest", digest) == digest


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.exists(dst):
        os.remove(dst)
    try:
        os.link(src, dst)
    except OSError:     # a filesystem without hard links
        shutil.copyfile(src, dst)


def _reuse_final(data_dir: str, folder: str, index: int, offsets: np.ndarray, digest: str) -> bool:
    """Features of no layers (Medusa, a draft model: the final hidden states alone) from any
    finished folder of the same pass and tokens: same target run, no second one."""
    suffix = _pass_suffix(index)
    for name in sorted(os.listdir(data_dir)):
        donor = os.path.join(data_dir, name)
        rest = name[len("features-"):]
        if donor == folder or not name.startswith("features-") or not os.path.isdir(donor) or \
                ("-sampled-" in rest) != bool(suffix) or (suffix and not rest.endswith(suffix)):
            continue
        if _is_current(donor, offsets, digest):
            os.makedirs(folder, exist_ok=True)
            _link_or_copy(os.path.join(donor, "final.npy"), os.path.join(folder, "final.npy"))
            np.lib.format.open_memmap(os.path.join(folder, "aux.npy"), "w+", np.float16,
                                      (int(offsets[-1]), 0)).flush()
            np.save(os.path.join(folder, "offsets.npy"), offsets)
            # the target run that made them: what these features cost to build
            _finish(folder, digest, _done_facts(donor).get("seconds"), linked_from=name)
            return True
    return False


def write_features(runner, data_dir: str, seqs: list[dict], layers: tuple[int, ...],
                   index: int = 0) -> str:
    """Computes and stores the features of every sequence of pass ``index`` (float16);
    returns their folder."""
    from tqdm import tqdm
    folder = _features_folder(data_dir, layers, index)
    t0 = time.perf_counter()
    lengths = [len(s["prompt"]) + len(s["output"]) for s in seqs]
    offsets = np.cumsum([0] + lengths).astype(np.int64)
    digest = _tokens_digest(seqs)
    if _is_current(folder, offsets, digest):
        return folder
    done = os.path.join(folder, "done")
    if os.path.isfile(done):
        os.remove(done)
    if not layers and _reuse_final(data_dir, folder, index, offsets, digest):
        return folder
    os.makedirs(folder, exist_ok=True)
    h = runner.model.args.hidden_size
    total = int(offsets[-1])
    aux = np.lib.format.open_memmap(os.path.join(folder, "aux.npy"), "w+", np.float16,
                                    (total, len(layers) * h))
    final_path = os.path.join(folder, "final.npy")
    if os.path.exists(final_path):      # maybe a hard link shared with another folder
        os.remove(final_path)
    final = np.lib.format.open_memmap(final_path, "w+", np.float16, (total, h))
    rows = extract_features(runner, [s["prompt"] + s["output"] for s in seqs], layers)
    for i, (a, f) in enumerate(tqdm(rows, total=len(seqs), desc="target hidden states")):
        aux[offsets[i]:offsets[i + 1]] = a.numpy().astype(np.float16)
        final[offsets[i]:offsets[i + 1]] = f.numpy().astype(np.float16)
    aux.flush()
    final.flush()
    np.save(os.path.join(folder, "offsets.npy"), offsets)
    _finish(folder, digest, time.perf_counter() - t0)
    return folder


def load_sequences(data_dir: str, layers: tuple[int, ...], index: int = 0) -> list[TrainSequence]:
    """Pass ``index``'s cached continuations with their features (memory-mapped, widened per
    sequence)."""
    with open(_continuations_path(data_dir, index)) as f:
        seqs = json.load(f)["sequences"]
    folder = _features_folder(data_dir, layers, index)
    aux = np.load(os.path.join(folder, "aux.npy"), mmap_mode="r")
    final = np.load(os.path.join(folder, "final.npy"), mmap_mode="r")
    offsets = np.load(os.path.join(folder, "offsets.npy"))
    out = []
    for i, s in enumerate(seqs):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        out.append(TrainSequence(torch.tensor(s["prompt"] + s["output"], dtype=torch.int64),
                                 len(s["prompt"]), torch.from_numpy(aux[lo:hi].astype(np.float32)),
                                 torch.from_numpy(final[lo:hi].astype(np.float32)),
                                 prompt_index=i, sampled=index > 0))
    return out


# facts of caches written before the key existed
_FACTS_BEFORE = {"turns": "first", "temperature": 0.0}


def prepare(llm, data_dir: str, layers: tuple[int, ...], num_prompts: int, max_tokens: int,
            max_prompt_tokens: int, seed: int, model_name: str,
            prompts: Optional[list[list[int]]] = None, turns: str = "first",
            sampled_passes: int = 0, temperature: float = 0.8) -> list[TrainSequence]:
    """Continuations (each pass cached in ``data_dir`` unless its facts differ) + features for
    ``layers`` -> sequences: the greedy pass, then ``sampled_passes`` passes sampled at
    ``temperature``. ``prompts``: token-id prompts instead of ShareGPT's (tests)."""
    if sampled_passes < 0 or (sampled_passes and not temperature > 0):
        raise ValueError(f"sampled passes need a count >= 0 and a temperature > 0, got "
                         f"{sampled_passes} at {temperature}")
    os.makedirs(data_dir, exist_ok=True)
    facts = {"model": model_name, "num_prompts": num_prompts, "max_tokens": max_tokens,
             "max_prompt_tokens": max_prompt_tokens, "seed": seed,
             "source": "ids" if prompts is not None else "sharegpt-calibration", "turns": turns}
    out = []
    for index in range(1 + sampled_passes):
        pass_facts = {**facts, "temperature": temperature if index else 0.0}
        path = _continuations_path(data_dir, index)
        cached = None
        if os.path.isfile(path):
            with open(path) as f:
                cached = json.load(f)
        if cached is None or any(cached.get(k, _FACTS_BEFORE.get(k)) != v for k, v in pass_facts.items()):
            if prompts is None:
                prompts = calibration_prompts(llm.get_tokenizer(), num_prompts, max_prompt_tokens,
                                              seed, turns=turns)
            # pass i's prompt j draws from seed (seed + i) * 1_000_003 + j: no two share one
            t0 = time.perf_counter()
            seqs = generate_continuations(llm, prompts[:num_prompts], max_tokens,
                                          pass_facts["temperature"], (seed + index) * 1_000_003)
            with open(path + ".tmp", "w") as f:
                json.dump({**pass_facts, "seconds": round(time.perf_counter() - t0, 1),
                           "sequences": seqs}, f)
            os.replace(path + ".tmp", path)
        else:
            seqs = cached["sequences"]
        write_features(llm.engine.runner, data_dir, seqs, tuple(layers), index)
        out += load_sequences(data_dir, tuple(layers), index)
    return out


def build_seconds(data_dir: str, layers: tuple[int, ...], passes: int = 1) -> Optional[float]:
    """Seconds the cached data of ``passes`` passes took to build when it was built
    (continuations + the target run for ``layers``), whoever built it; None where a cache
    from before these records exists."""
    total = 0.0
    for index in range(passes):
        with open(_continuations_path(data_dir, index)) as f:
            generated = json.load(f).get("seconds")
        built = (_done_facts(_features_folder(data_dir, layers, index)) or {}).get("seconds")
        if generated is None or built is None:
            return None
        total += generated + built
    return round(total, 1)


def choose_draft_vocab(data, vocab_size: int, size: int) -> torch.Tensor:
    """[size] ascending target ids: the most frequent continuation tokens of ``data`` (then
    prompt tokens, then the lowest ids): a drafter's reduced vocabulary."""
    if size >= vocab_size:
        return torch.arange(vocab_size)
    cont, prompt = Counter(), Counter()
    for seq in data or ():
        ids = seq.token_ids.tolist()
        cont.update(ids[seq.prompt_len:])
        prompt.update(ids[:seq.prompt_len])
    chosen = [t for t, _ in cont.most_common(size)]
    seen = set(chosen)
    for t, _ in prompt.most_common():
        if len(chosen) == size:
            break
        if t not in seen:
            chosen.append(t)
            seen.add(t)
    fill = (t for t in range(vocab_size) if t not in seen)
    chosen.extend(next(fill) for _ in range(size - len(chosen)))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def split_heldout(seqs: list[TrainSequence], fraction: float, seed: int):
    """(train, held-out): a seeded random ``fraction`` of the greedy sequences held out, and
    every sampled continuation of a held-out prompt left out of training (it would leak the
    prompt). Sequences without a prompt index count as distinct prompts."""
    keys = [s.prompt_index if s.prompt_index >= 0 else -1 - i for i, s in enumerate(seqs)]
    greedy = [i for i, s in enumerate(seqs) if not s.sampled]
    order = list(range(len(greedy)))
    random.Random(seed).shuffle(order)
    n = max(1, int(round(len(greedy) * fraction))) if len(greedy) > 1 else 0
    held = {greedy[j] for j in order[:n]}
    held_keys = {keys[i] for i in held}
    train = [s for i, s in enumerate(seqs) if keys[i] not in held_keys]
    return train, [s for i, s in enumerate(seqs) if i in held]

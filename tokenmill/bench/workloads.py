"""Token-id workloads for `bench ablate` (and any bench that wants them): ShareGPT chat turns
with their reference answer lengths, the same turns behind one shared system prompt (prefix
caching), and input-grounded tasks (copy / rewrite a given text: n-gram speculation). Without
a tokenizer (tiny test models) each has a random-token stand-in of the same shape."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

SYSTEM_PROMPT = (
    "You are Millbrook Assistant, the help desk of the Millbrook public library. Answer "
    "questions from library members politely and briefly. The library opens at eight in the "
    "morning and closes at eight in the evening from Monday to Friday, and opens from ten to "
    "four on Saturdays; it is closed on Sundays and public holidays. Members may borrow up to "
    "twelve books, four films and two board games at a time. Books are lent for three weeks, "
    "films and games for one week, and every loan can be renewed twice online or at the front "
    "desk unless another member has reserved the item. Late returns cost twenty cents a day per "
    "item, up to five dollars. The reading room on the first floor is a quiet space; group study "
    "rooms on the second floor can be booked for two hours a day. Printing costs ten cents a "
    "page in black and white and fifty cents in colour. Children's story time is on Tuesday and "
    "Thursday mornings at ten. If you do not know an answer, say so and suggest asking a "
    "librarian at the front desk; never invent opening hours, fees or rules. Keep answers short, "
    "friendly and specific, and do not discuss topics unrelated to the library unless the member "
    "asks for help finding books about them.")

# Input-grounded tasks: the answer copies the text, which n-gram speculation looks up.
GROUNDED_TEXTS = [
    "The river town of Millbrook holds a market every Saturday. Farmers bring apples, honey and "
    "fresh bread, and the baker sells out of rye loaves before noon. In winter the market moves "
    "into the old grain hall, where a brass band plays on the first Saturday of each month.",
    "To reset the router, hold the small button on the back for ten seconds until the light "
    "turns orange. Wait two minutes for the light to turn green, then connect to the network "
    "named HOME-SETUP and open the address printed on the label to choose a new password.",
    "The committee met on Tuesday and agreed on three points: the library will open at eight "
    "instead of nine, the reading room will stay quiet after six, and a new shelf for local "
    "history books will be built next to the main entrance before the end of the year.",
    "Water the tomato plants every morning, early, before the sun is high. Feed them once a week "
    "with a liquid fertiliser, pinch out the side shoots as they appear, and tie the main stem "
    "to a cane so that the weight of the fruit does not snap it in the wind.",
]
GROUNDED_TASKS = [
    "Here is a text:\n\n{text}\n\nWrite the text again, exactly as it is.",
    "Here is a text:\n\n{text}\n\nCopy the text above word for word.",
    "Here is a text:\n\n{text}\n\nRewrite the text above, keeping every sentence.",
    "Here is a text:\n\n{text}\n\nRepeat the first two sentences of the text.",
]


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def max_need(self) -> int:
        """Most KV tokens one request of this workload can hold."""
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))

    def head(self, num: int, max_tokens: int) -> "Workload":
        return Workload(self.name, self.prompts[:num], [min(max_tokens, n) for n in self.output_lens[:num]])


def random_ids(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random token ids away from the special ids at the start of the vocabulary."""
    return [rng.randrange(min(100, vocab // 2), vocab) for _ in range(length)]


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def sharegpt_turns(tokenizer, convs: list[list[dict]], num: int, max_input_len: int,
                   output_len: int, fixed_output_len: bool, seed: int,
                   system: Optional[str] = None) -> Workload:
    """First user turns of ShareGPT conversations (``tokenmill.data.sharegpt.conversations``;
    chat template applied, behind ``system`` if given), up to ``max_input_len`` tokens; each
    output length is its reference answer's token count, clipped to [8, output_len] (all
    ``output_len`` if ``fixed_output_len``)."""
    prefix = [{"role": "system", "content": system}] if system else []
    pairs = []
    empty = len(_chat_ids(tokenizer, prefix + [{"role": "user", "content": ""}]))
    for conv in convs:
        ids = _chat_ids(tokenizer, prefix + [conv[0]])
        if len(ids) - empty < 4 or len(ids) > max_input_len:
            continue
        # a prefix of the answer is enough to know whether it reaches output_len tokens
        answer = len(tokenizer.encode(conv[1]["content"][:8 * output_len], add_special_tokens=False))
        pairs.append((ids, output_len if fixed_output_len else max(8, min(output_len, answer))))
    if len(pairs) < num:
        raise ValueError(f"only {len(pairs)} ShareGPT prompts fit in {max_input_len} tokens; "
                         "raise --max-input-len or lower --num-prompts")
    random.Random(seed).shuffle(pairs)
    pairs = pairs[:num]
    return Workload("sharegpt" + ("+system prompt" if system else ""),
                    [p for p, _ in pairs], [n for _, n in pairs])


def random_turns(vocab: int, num: int, input_len: int, output_len: int, fixed_output_len: bool,
                 seed: int, shared_prefix: int = 0) -> Workload:
    """Random-token prompts of ``input_len // 2 .. input_len`` tokens (after a common
    ``shared_prefix``), output lengths ``output_len // 4 .. output_len``."""
    rng = random.Random(seed)
    prefix = random_ids(rng, shared_prefix, vocab)
    prompts = [prefix + random_ids(rng, rng.randint(max(1, input_len // 2), input_len), vocab)
               for _ in range(num)]
    lens = [output_len if fixed_output_len else rng.randint(max(1, output_len // 4), output_len)
            for _ in range(num)]
    return Workload("random" + (f"+{shared_prefix}-token shared prefix" if shared_prefix else ""),
                    prompts, lens)


def grounded_tasks(tokenizer, num: int, output_len: int) -> Workload:
    """Copy / rewrite / answer-from-a-given-text tasks: the answer repeats the input, which
    n-gram (prompt lookup) speculation exploits."""
    texts = [t.format(text=x) for x in GROUNDED_TEXTS for t in GROUNDED_TASKS]
    prompts = [_chat_ids(tokenizer, [{"role": "user", "content": texts[i % len(texts)]}])
               for i in range(num)]
    return Workload("grounded (copy / rewrite a text)", prompts, [output_len] * num)


def random_grounded(vocab: int, num: int, input_len: int, output_len: int, seed: int) -> Workload:
    """Stand-in without a tokenizer: a random text given twice (something to look up)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        text = random_ids(rng, max(2, input_len // 2), vocab)
        prompts.append(text + text)
    return Workload("random repeated text", prompts, [output_len] * num)

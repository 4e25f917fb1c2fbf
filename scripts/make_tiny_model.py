"""Regenerate the tiny default model and data set shipped in ``deg_hf/assets``.

Everything is derived from one seed:

* ``data/{preference,kto,sft}/{train,test}.jsonl``: templated questions about who holds which object
  ("Ann has a red ball and Bob has a blue kite. What does Ann have?"). The chosen answer names the
  right object and closes politely; the rejected one names the other person's object and closes
  rudely. The rule does not depend on the names or objects, so it carries over to held-out prompts,
  and both answers have about the same length.
* ``tiny_llama/``: a byte-level BPE tokenizer trained on the training text, with a chatml-like chat
  template, and a small ``LlamaForCausalLM`` (2 layers, hidden 128) pretrained for 3000 steps of 32
  fresh questions from the same generator (never a test prompt), each followed by its chosen or
  its rejected answer with equal odds, as plain text or as a chat. It learns to copy the objects
  from the question and writes sensible text, but prefers neither answer: the preference is left
  for DPO, KTO and friends to learn.

Usage::

    python scripts/make_tiny_model.py                    # rewrite deg_hf/assets (about 2 minutes on 2 cores)
    python scripts/make_tiny_model.py --data-only --out /tmp/x   # data only, no torch import

Running it twice on the same machine and torch build gives byte-identical files (the data files
do not depend on torch at all).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "deg_hf" / "assets"

N_TRAIN = 480
N_TEST = 96

NAMES = [
    "Ann", "Bob", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivan", "Jill", "Kai", "Lena",
    "Max", "Nora", "Omar", "Pia", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Yara", "Zoe",
    "Leo", "Mia", "Noah", "Ruby", "Theo", "Ben",
]  # fmt: skip
COLORS = ["red", "blue", "green", "black", "white", "pink", "brown", "gray", "gold", "purple", "yellow", "silver"]
OBJECTS = [
    "ball", "kite", "hat", "cup", "book", "bike", "lamp", "box", "boat", "drum", "coat", "ring",
    "sock", "chair", "clock", "shoe", "bag", "pen", "key", "cake",
]  # fmt: skip
# (statement verb, question form, answer verb)
VERBS = [
    ("has", "What does {x} have?", "has"),
    ("owns", "What does {x} own?", "owns"),
    ("found", "What did {x} find?", "found"),
    ("wants", "What does {x} want?", "wants"),
    ("bought", "What did {x} buy?", "bought"),
    ("painted", "What did {x} paint?", "painted"),
]
JOINERS = ["{a} and {b}.", "{a}, while {b}.", "{a}, but {b}."]
POLITE = ["Happy to help.", "Hope this helps.", "Glad you asked.", "Thanks for asking."]
RUDE = ["Stop bugging me.", "Figure it out.", "Do not ask again.", "Leave me alone."]

PROMPT_PREFIX = "Question: "
PROMPT_SUFFIX = "\nAnswer:"

# tokenizer / model
PAD, EOS, IM_START = "<|pad|>", "<|im_end|>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, IM_START, EOS]
VOCAB_SIZE = 640
LR = 2e-3
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


# --------------------------------------------------------------------------------------------- data
def _question(rng: random.Random) -> tuple[str, str, str]:
    """One templated question: (question text, right answer, wrong answer), answers without closer."""
    a_name, b_name = rng.sample(NAMES, 2)
    a_col, b_col = rng.sample(COLORS, 2)
    a_obj, b_obj = rng.sample(OBJECTS, 2)
    verb, question, answer_verb = rng.choice(VERBS)
    joiner = rng.choice(JOINERS)
    statement = joiner.format(a=f"{a_name} {verb} a {a_col} {a_obj}", b=f"{b_name} {verb} a {b_col} {b_obj}")
    asked_first = rng.random() < 0.5
    who = a_name if asked_first else b_name
    right, wrong = (f"{a_col} {a_obj}", f"{b_col} {b_obj}") if asked_first else (f"{b_col} {b_obj}", f"{a_col} {a_obj}")
    text = f"{statement} {question.format(x=who)}"
    return text, f"{who} {answer_verb} a {right}.", f"{who} {answer_verb} a {wrong}."


def make_pairs(seed: int) -> dict[str, list[dict]]:
    """Preference pairs ``{"train": [...], "test": [...]}`` with disjoint prompts."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < N_TRAIN + N_TEST:
        question, right, wrong = _question(rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append(
            {
                "prompt": PROMPT_PREFIX + question + PROMPT_SUFFIX,
                "chosen": f" {right} {rng.choice(POLITE)}",
                "rejected": f" {wrong} {rng.choice(RUDE)}",
            }
        )
    return {"train": rows[:N_TRAIN], "test": rows[N_TRAIN:]}


def question_of(prompt: str) -> str:
    """The bare question of a preference prompt, used as the user turn of the chat views."""
    return prompt.removeprefix(PROMPT_PREFIX).removesuffix(PROMPT_SUFFIX)


def make_views(pairs: dict[str, list[dict]]) -> dict[str, dict[str, list[dict]]]:
    views: dict[str, dict[str, list[dict]]] = {"preference": {}, "kto": {}, "sft": {}}
    for split, rows in pairs.items():
        views["preference"][split] = rows
        views["kto"][split] = [
            {"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}
            for r in rows
            for key in ("chosen", "rejected")
        ]
        views["sft"][split] = [
            {
                "messages": [
                    {"role": "user", "content": question_of(r["prompt"])},
                    {"role": "assistant", "content": r["chosen"].strip()},
                ]
            }
            for r in rows
        ]
    return views


def write_data(out: Path, seed: int) -> dict[str, list[dict]]:
    pairs = make_pairs(seed)
    data = out / "data"
    for view, splits in make_views(pairs).items():
        (data / view).mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            with open(data / view / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return pairs


# ---------------------------------------------------------------------------------------- tokenizer
def _as_texts(prompt: str, completion: str) -> list[str]:
    """One prompt and completion as plain text and as a chat, each ending with the eos token."""
    return [
        prompt + completion + EOS,
        f"{IM_START}user\n{question_of(prompt)}{EOS}\n{IM_START}assistant\n{completion.strip()}{EOS}\n",
    ]


def pretraining_texts(pairs: dict[str, list[dict]], seed: int, n: int) -> list[str]:
    """``n`` pretraining texts: fresh questions from the data generator (never a test prompt), each
    followed by its chosen or its rejected answer with equal odds, as plain text or as a chat."""
    rng = random.Random(f"pretrain-{seed}")
    test_prompts = {r["prompt"] for r in pairs["test"]}
    texts: list[str] = []
    while len(texts) < n:
        question, right, wrong = _question(rng)
        prompt = PROMPT_PREFIX + question + PROMPT_SUFFIX
        if prompt in test_prompts:
            continue
        if rng.random() < 0.5:
            completion = f" {right} {rng.choice(POLITE)}"
        else:
            completion = f" {wrong} {rng.choice(RUDE)}"
        texts.append(rng.choice(_as_texts(prompt, completion)))
    return texts


def build_tokenizer(rows: list[dict]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = []
    for r in rows:
        corpus += [r["prompt"] + r["chosen"], r["prompt"] + r["rejected"], question_of(r["prompt"])]
    corpus += [f"{IM_START}user\n", f"{IM_START}assistant\n"]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=[IM_START],
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ------------------------------------------------------------------------------------------- model
def pretrain(tokenizer, pairs: dict[str, list[dict]], seed: int, steps: int, batch: int = 32, log_every: int = 100):
    """A fresh ``LlamaForCausalLM`` trained for ``steps`` steps of ``batch`` new texts each."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **MODEL_CONFIG,
    )
    model = LlamaForCausalLM(config).float()
    texts = pretraining_texts(pairs, seed, steps * batch)
    enc = tokenizer(texts, add_special_tokens=False)["input_ids"]

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * step / steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    t0 = time.time()
    running = None
    for step in range(steps):
        chunk = enc[step * batch : (step + 1) * batch]
        width = max(len(e) for e in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, e in enumerate(chunk):
            ids[i, : len(e)] = torch.tensor(e)
            mask[i, : len(e)] = 1
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()
        running = loss if running is None else 0.95 * running + 0.05 * loss
        if log_every and (step + 1) % log_every == 0:
            print(f"pretrain step {step + 1}/{steps} loss {running:.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    return model


def write_model(out: Path, pairs: dict[str, list[dict]], seed: int, steps: int) -> None:
    import torch
    from transformers import GenerationConfig

    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    tokenizer = build_tokenizer(pairs["train"])
    model = pretrain(tokenizer, pairs, seed, steps)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=32,
        do_sample=False,
    )
    target = out / "tiny_llama"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    for path in target.iterdir():  # safetensors writes 0600; the package data should be world-readable
        path.chmod(0o644)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="assets folder (default: deg_hf/assets)")
    parser.add_argument("--data-only", action="store_true", help="write only data/, without torch")
    parser.add_argument("--steps", type=int, default=3000, help="pretraining steps")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.time()
    pairs = write_data(args.out, args.seed)
    print(f"data: {len(pairs['train'])} train / {len(pairs['test'])} test pairs -> {args.out / 'data'}")
    if not args.data_only:
        write_model(args.out, pairs, args.seed, args.steps)
        print(f"model -> {args.out / 'tiny_llama'}")
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

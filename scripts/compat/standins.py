"""Offline stand-ins for the Hub repositories TRL's DPO and KTO tests load.

* ``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5``: a tiny random Qwen2 (2 layers, hidden 8,
  bfloat16, untied LM head, like the Hub one) with a byte-level tokenizer (every byte a token, so any
  text round-trips) and a ChatML-style chat template. It is written into a Hugging Face cache
  directory (``HF_HOME/hub``) in the Hub cache layout, so ``from_pretrained`` and
  ``snapshot_download`` find it with ``HF_HUB_OFFLINE=1`` under its Hub id.
* ``trl-internal-testing/zen``: the preference configurations TRL's tests use, with the same
  columns and split sizes (19 rows, the last 10% unshuffled as ``test``), written as JSON lines.
  The texts are our own.

``python scripts/compat/standins.py DIR`` writes both under ``DIR`` (``DIR/hf_home``,
``DIR/datasets``); ``standins.load_dataset`` reads the datasets back.
"""

from __future__ import annotations

import json
import os
import sys

QWEN2_ID = "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5"
ZEN_ID = "trl-internal-testing/zen"
#: Hub ids a stand-in exists for
MODELS = (QWEN2_ID,)
DATASETS = (ZEN_ID,)
_COMMIT = "0" * 39 + "1"  # the snapshot's (made-up) commit hash

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# (question, prompt prefix, good completion, poor completion): the rows of every configuration
_ROWS = [
    ("What keeps bread fresh?", "Bread stays fresh", " in a cloth bag.", " on a sunny shelf."),
    ("What makes soup thicker?", "Soup gets thicker", " with a little flour.", " with more water."),
    ("How should rice be rinsed?", "Rinse rice", " until the water runs clear.", " never, just fry it."),
    ("When is pasta done?", "Pasta is done", " when it is tender but firm.", " after an hour."),
    ("What softens butter quickly?", "Butter softens", " when cut into cubes.", " in the freezer."),
    ("How do you stop onions stinging?", "Onions sting less", " with a sharp knife.", " when you cry first."),
    ("What does salt do to water?", "Salt in water", " raises its boiling point a bit.", " makes it freeze."),
    ("Why rest a roast?", "Resting a roast", " keeps the juices in.", " cools the oven."),
    ("What goes with tomatoes?", "Tomatoes go well", " with basil.", " with chocolate syrup."),
    ("How should herbs be kept?", "Keep herbs", " in a glass of water.", " in a hot pan."),
    ("What helps dough rise?", "Dough rises", " in a warm place.", " in the fridge overnight only."),
    ("When should eggs be salted?", "Salt eggs", " just before cooking.", " a week ahead."),
    ("How do you peel garlic fast?", "Garlic peels fast", " if you crush it lightly.", " if you boil it dry."),
    ("What keeps a knife sharp?", "A knife stays sharp", " on a wooden board.", " on a glass plate."),
    ("Why toast spices?", "Toasting spices", " wakes up their flavour.", " removes their colour."),
    ("What thickens a sauce fast?", "A sauce thickens", " as it reduces.", " when you add ice."),
    ("How is fish best cooked?", "Fish is best", " cooked gently.", " cooked for hours."),
    ("What keeps berries firm?", "Berries stay firm", " when washed just before eating.", " in warm water."),
    ("Any last tip?", "The last tip:", " taste as you go.", " never taste anything."),
]
_LABELS = [True, False, True, True, False, True, False, True, True, False, True, False, True, True, False,
           True, False, True, True]


def zen_configs() -> dict[str, list[dict]]:
    """Every zen configuration TRL's DPO and KTO tests read, as lists of rows."""
    def user(text):
        return [{"role": "user", "content": text}]

    def assistant(text):
        return [{"role": "assistant", "content": text.strip()}]

    rows = {
        "standard_preference": [
            {"prompt": p, "chosen": c, "rejected": r} for _, p, c, r in _ROWS],
        "standard_implicit_prompt_preference": [
            {"chosen": p + c, "rejected": p + r} for _, p, c, r in _ROWS],
        "standard_unpaired_preference": [
            {"prompt": p, "completion": c if label else r, "label": label}
            for (_, p, c, r), label in zip(_ROWS, _LABELS)],
        "conversational_preference": [
            {"prompt": user(q), "chosen": assistant(c), "rejected": assistant(r)} for q, _, c, r in _ROWS],
        "conversational_implicit_prompt_preference": [
            {"chosen": user(q) + assistant(c), "rejected": user(q) + assistant(r)} for q, _, c, r in _ROWS],
        "conversational_unpaired_preference": [
            {"prompt": user(q), "completion": assistant(c if label else r), "label": label}
            for (q, _, c, r), label in zip(_ROWS, _LABELS)],
    }
    return rows


def write_datasets(directory: str) -> str:
    """``directory/zen/<config>/{train,test}.jsonl``; returns ``directory``."""
    for config, rows in zen_configs().items():
        n_test = max(1, round(len(rows) * 0.1))
        split_dir = os.path.join(directory, "zen", config)
        os.makedirs(split_dir, exist_ok=True)
        for split, part in (("train", rows[:-n_test]), ("test", rows[-n_test:])):
            with open(os.path.join(split_dir, f"{split}.jsonl"), "w", encoding="utf-8") as fh:
                for row in part:
                    fh.write(json.dumps(row) + "\n")
    return directory


def load_dataset(directory: str, path: str, name: str | None = None, split: str | None = None, **kwargs):
    """``datasets.load_dataset`` for the zen stand-in (same arguments: ``split``, ``streaming``...)."""
    import datasets

    if path != ZEN_ID:
        raise LookupError(f"no offline stand-in for the dataset {path!r}")
    config_dir = os.path.join(directory, "zen", name or "")
    if not name or not os.path.isdir(config_dir):
        raise LookupError(f"no offline stand-in for {path!r} configuration {name!r}")
    files = {s: os.path.join(config_dir, f"{s}.jsonl") for s in ("train", "test")}
    return datasets.load_dataset("json", data_files=files, split=split, **kwargs)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], model_max_length=1024,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _snapshot_dir(hf_home: str, repo_id: str) -> str:
    repo_dir = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
    with open(os.path.join(repo_dir, "refs", "main"), "w") as fh:
        fh.write(_COMMIT)
    snapshot = os.path.join(repo_dir, "snapshots", _COMMIT)
    os.makedirs(snapshot, exist_ok=True)
    return snapshot


def write_qwen2(hf_home: str, seed: int = 0) -> str:
    """The tiny Qwen2 stand-in, in the Hub cache layout under ``hf_home``; returns the snapshot dir."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    snapshot = _snapshot_dir(hf_home, QWEN2_ID)
    tok = _tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=8, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(snapshot)
    tok.save_pretrained(snapshot)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(snapshot)
    return snapshot


def environment(directory: str) -> dict[str, str]:
    """The environment that makes the stand-ins under ``directory`` visible, offline. The Hub
    libraries read it when they are first imported: set it before importing them."""
    return {
        "HF_HOME": os.path.join(directory, "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "DEG_COMPAT_DATASETS": os.path.join(directory, "datasets"),
    }


def write_all(directory: str) -> dict[str, str]:
    """Write every stand-in under ``directory`` (once); returns :func:`environment`."""
    env = environment(directory)
    marker = os.path.join(directory, ".complete")
    if not os.path.exists(marker):
        write_qwen2(env["HF_HOME"])
        write_datasets(env["DEG_COMPAT_DATASETS"])
        open(marker, "w").close()
    return env


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: standins.py DIR")
    for key, value in write_all(sys.argv[1]).items():
        print(f"{key}={value}")

"""Tiny real checkpoints on disk, a real offline tokenizer, and task rows, for the tests.

Every checkpoint is written with ``save_pretrained`` (config.json + model.safetensors + tokenizer
files) so tests run the real loading code, offline.
"""

from __future__ import annotations

import os

WORDS = (
    "hello world hi yo the cat sat on mat good bad answer question please thanks a an is it what "
    "why how tell me about sky blue red green tree river stone fire water kind rude sure no yes"
).split()

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} <|end|> "
    "{% else %}<|assistant|> {{ m['content'] }} <|end|> {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2")


def write_tokenizer(directory: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"],
        model_max_length=256,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    return tok


def vocab_size() -> int:
    return len(SPECIALS) + len(WORDS)


def make_config(arch: str, *, n_layers: int = 2, hidden: int = 32, vocab: int | None = None, **extra):
    import transformers

    vocab = vocab or 64
    assert vocab >= vocab_size()
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=False, **common)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, **common)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(tie_word_embeddings=True, head_dim=8, **common)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(head_dim=8, sliding_window=64, **common)
        cfg._attn_implementation = "eager"
    else:
        raise ValueError(arch)
    for key, value in extra.items():
        setattr(cfg, key, value)
    return cfg


def write_checkpoint(directory: str, arch: str = "llama", *, seed: int = 7, **config_kwargs) -> str:
    """Write a tiny random checkpoint of ``arch`` with its tokenizer; return the directory."""
    import torch
    from transformers import AutoModelForCausalLM

    os.makedirs(directory, exist_ok=True)
    torch.manual_seed(seed)
    cfg = make_config(arch, **config_kwargs)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def randomise_lora_b(model, seed: int = 11, scale: float = 0.05) -> int:
    """PEFT initialises lora_B to zero, so until B is randomised an adapter changes nothing and any
    "did the adapter run" assertion passes vacuously. Returns how many tensors were set."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype) * scale)
                count += 1
    return count


def copy_adapters(dst, src) -> int:
    """Copy every LoRA tensor of ``src`` into ``dst`` (same names); returns the number copied."""
    import torch

    source = {k: v for k, v in src.state_dict().items() if "lora_" in k}
    copied = 0
    with torch.no_grad():
        for key, tensor in dst.state_dict().items():
            if "lora_" in key and key in source:
                tensor.copy_(source[key])
                copied += 1
    return copied


def adapter_state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def lora_grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


# ---------------------------------------------------------------- rows for each task

PROMPTS = ["tell me about the sky", "what is a river", "how is the tree", "tell me about fire",
           "what is water", "why is the stone", "tell me about the cat", "what is green"]


def pref_rows(n: int = 8):
    return [
        {"prompt": PROMPTS[i % len(PROMPTS)], "chosen": " good answer please thanks" if i % 2 else " sure good kind answer",
         "rejected": " bad rude no" if i % 3 else " no"}
        for i in range(n)
    ]


def kto_rows(n: int = 8):
    rows = []
    for i, r in enumerate(pref_rows(n)):
        rows.append({"prompt": r["prompt"], "completion": r["chosen"] if i % 2 == 0 else r["rejected"], "label": i % 2 == 0})
    return rows


def sft_rows(n: int = 8):
    return [
        {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["chosen"].strip()}]}
        for r in pref_rows(n)
    ]


def trainer_kwargs(output_dir: str, **overrides) -> dict:
    """Arguments that keep a CPU test run exact, quiet and small."""
    kwargs = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_steps=3,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return kwargs

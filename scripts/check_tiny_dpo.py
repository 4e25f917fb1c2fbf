"""Check that the tiny assets carry a learnable preference: LoRA DPO lifts held-out reward accuracy.

Runs TRL's ``DPOTrainer`` with a PEFT LoRA adapter on the ``preference`` train split, on CPU, and
prints the held-out (``test`` split) reward accuracy from ``trainer.evaluate()`` before and after
training, plus how often the base model alone already gives the chosen answer the higher log-prob.

Before training the adapter is zero, so policy and reference agree exactly, every implicit reward
is 0 and TRL's strict ``chosen > rejected`` accuracy reads 0.0; the base-model preference line is
the meaningful "before" number (it should be near 0.5).

The preference is easy: even ``--lr 1e-4`` reaches about 0.99. Plain sigmoid DPO at ``--lr`` 5e-4 and
above also wrecks the tiny model's greedy text (it drives both log-probs down by tens of nats); the
"dpo greedy answers" line shows it. ``--loss-type sigmoid sft`` (RPO) or ``--lr 3e-4 --steps 100``
keep the text sensible and still reach 1.0.

    HF_HUB_OFFLINE=1 python scripts/check_tiny_dpo.py            # defaults: 150 steps, lr 2e-3
    HF_HUB_OFFLINE=1 python scripts/check_tiny_dpo.py --assets /tmp/x   # a regenerated copy
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def base_preference(model, tokenizer, rows) -> float:
    """Fraction of pairs where the model gives the chosen completion a higher summed log-prob."""
    import torch

    wins = 0
    with torch.no_grad():
        for r in rows:
            p = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
            scores = []
            for key in ("chosen", "rejected"):
                ids = tokenizer(r["prompt"] + r[key] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
                x = torch.tensor([ids])
                logp = model(input_ids=x).logits[0, :-1].log_softmax(-1)
                tok_logp = logp.gather(-1, x[0, 1:, None])[:, 0]
                scores.append(tok_logp[len(p) - 1 :].sum().item())
            wins += scores[0] > scores[1]
    return wins / len(rows)


def generation_stats(model, tokenizer, rows) -> tuple[float, float, float]:
    """Greedy answers to ``rows``: fractions naming either object of the prompt, naming the right one,
    and closing politely."""
    import torch

    polite = {r["chosen"].split(". ", 1)[1] for r in rows}
    copied = right = polite_n = 0
    with torch.no_grad():
        for r in rows:
            ids = tokenizer(r["prompt"], return_tensors="pt", add_special_tokens=False)
            out = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
            right += text.startswith(r["chosen"].split(". ", 1)[0] + ".")
            copied += text.startswith((r["chosen"].split(". ", 1)[0] + ".", r["rejected"].split(". ", 1)[0] + "."))
            polite_n += any(p in text for p in polite)
    return copied / len(rows), right / len(rows), polite_n / len(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=REPO / "deg_hf" / "assets")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss-type", nargs="+", default=["sigmoid"], help='e.g. "sigmoid sft" (RPO)')
    parser.add_argument("--loss-weights", nargs="+", type=float, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)

    def rows(split):
        with open(args.assets / "data" / "preference" / f"{split}.jsonl", encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    train_rows, test_rows = rows("train"), rows("test")
    model_dir = str(args.assets / "tiny_llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    base_pref_test = base_preference(model, tokenizer, test_rows)
    base_pref_train = base_preference(model, tokenizer, train_rows[:96])
    print(f"base model prefers chosen: test {base_pref_test:.3f}, train[:96] {base_pref_train:.3f}")
    base_gen = generation_stats(model, tokenizer, test_rows[:48])
    print("base greedy answers on test[:48]: either object {:.2f}, right object {:.2f}, polite {:.2f}".format(*base_gen))

    with tempfile.TemporaryDirectory() as out:
        config = DPOConfig(
            output_dir=out,
            per_device_train_batch_size=args.batch,
            per_device_eval_batch_size=32,
            max_steps=args.steps,
            learning_rate=args.lr,
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=10,
            beta=args.beta,
            loss_type=args.loss_type,
            loss_weights=args.loss_weights,
            max_length=args.max_length,
            bf16=False,
            fp16=False,
            activation_checkpointing=False,  # TRL turns it on by default; pointless for a tiny model
            use_cpu=True,
            report_to="none",
            logging_steps=25,
            save_strategy="no",
            eval_strategy="no",
            dataloader_num_workers=0,
            seed=args.seed,
            disable_tqdm=True,
        )
        peft_config = LoraConfig(
            r=args.r, lora_alpha=args.alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
        t0 = time.time()
        trainer = DPOTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(train_rows),
            eval_dataset=Dataset.from_list(test_rows),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        before = trainer.evaluate()
        t1 = time.time()
        trainer.train()
        t2 = time.time()
        after = trainer.evaluate()
        t3 = time.time()

    result = {
        "base_pref_test": base_pref_test,
        "before_acc": before["eval_rewards/accuracies"],
        "before_margin": before["eval_rewards/margins"],
        "after_acc": after["eval_rewards/accuracies"],
        "after_margin": after["eval_rewards/margins"],
        "train_s": t2 - t1,
        "total_s": t3 - t0,
    }
    print(
        f"held-out reward accuracy: before {result['before_acc']:.3f} -> after {result['after_acc']:.3f} "
        f"(margin {result['before_margin']:.3f} -> {result['after_margin']:.3f})"
    )
    print(f"wall: train {result['train_s']:.1f}s, setup+eval+train {result['total_s']:.1f}s")

    policy = trainer.model
    policy.eval()
    dpo_gen = generation_stats(policy, tokenizer, test_rows[:48])
    print("dpo greedy answers on test[:48]: either object {:.2f}, right object {:.2f}, polite {:.2f}".format(*dpo_gen))
    result["base_generation"], result["dpo_generation"] = base_gen, dpo_gen
    r = test_rows[0]
    ids = tokenizer(r["prompt"], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        gen = policy.generate(**ids, max_new_tokens=20, do_sample=False)
        with policy.disable_adapter():
            ref_gen = policy.generate(**ids, max_new_tokens=20, do_sample=False)
    print("prompt:", r["prompt"].replace("\n", " / "))
    print("  base:", tokenizer.decode(ref_gen[0, ids["input_ids"].shape[1] :]))
    print("  dpo :", tokenizer.decode(gen[0, ids["input_ids"].shape[1] :]))
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["after_acc"] >= 0.8 else 1)

"""trainer.push_to_hub() goes through deg_hf's push: exact files, a deg_hf card, no token, no path."""

from __future__ import annotations

from harness import sft_rows, trainer_kwargs
from test_hub import FAKE_TOKEN, hub  # noqa: F401  (the HfApi-intercepting fixture)


def test_trainer_push_to_hub_uploads_the_checkpoint_files_only(checkpoint, tmp_path, hub):  # noqa: F811
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    path = checkpoint("llama")
    out = tmp_path / "run"
    trainer = StreamedSFTTrainer(
        model=path,
        args=StreamedSFTConfig(**trainer_kwargs(str(out), max_length=32, max_steps=1, hub_model_id="me/tiny-sft")),
        train_dataset=Dataset.from_list(sft_rows(4)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    # a Hub base: a local base path in adapter_config.json would be refused (no local paths uploaded)
    trainer.model.peft_config["default"].base_model_name_or_path = "org/tiny-llama"
    trainer.train()
    url = trainer.push_to_hub()
    assert "me/tiny-sft" in url
    names = set(hub["uploaded"])
    assert {"adapter_model.safetensors", "adapter_config.json", "deg.json", "README.md", "tokenizer.json"} <= names
    assert not names & {"training_args.bin", "optimizer.pt", "scheduler.pt"}
    card = hub["uploaded"]["README.md"].decode()
    assert "deg-hf" in card and "library_name: peft" in card
    for name, data in hub["uploaded"].items():
        text = data.decode("utf-8", "ignore")
        assert FAKE_TOKEN not in text and str(tmp_path) not in text, name

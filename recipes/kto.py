"""Kahneman-Tversky Optimization (LoRA) with layers streamed from host memory.

KTO's KL term pairs each completion with another prompt of its micro-batch, so it needs
--per_device_train_batch_size >= 2.

    python recipes/kto.py                                   # tiny embedded model and data, CPU
    python recipes/kto.py --config recipes/configs/kto.yaml --max_steps 100
    python recipes/kto.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct \
        --dataset_name trl-lib/kto-mix-14k --use_peft --output_dir outputs/qwen-kto

With no --model_name_or_path the tiny model shipped in deg_hf is used; with no --dataset_name the
embedded "kto" view (prompt/completion/label). Without --use_peft deg_hf trains its default LoRA
adapter.
"""

import torch
from datasets import load_dataset
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from deg_hf import StreamedKTOConfig, StreamedKTOTrainer, assets

RECIPE, VIEW = "kto", "kto"


def load_data(script_args):
    """(train, eval or None): the embedded view when no --dataset_name is given."""
    if script_args.dataset_name is None:
        return assets.tiny_dataset(VIEW, "train"), assets.tiny_dataset(VIEW, "test")
    data = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    return data[script_args.dataset_train_split], data.get(script_args.dataset_test_split)


def main(argv=None):
    parser = TrlParser((ScriptArguments, StreamedKTOConfig, ModelConfig))
    parser.set_defaults(dtype="auto")  # load in the checkpoint's own dtype, not TRL's float32
    if not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        parser.set_defaults(bf16=False)  # TRL defaults to bf16, which a CPU-only machine refuses
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    if training_args.output_dir in (None, "trainer_output"):  # the TRL/transformers default
        training_args.output_dir = f"outputs/{RECIPE}"
    model_args.model_name_or_path = model_args.model_name_or_path or assets.tiny_model_path()
    init_kwargs = {"revision": model_args.model_revision, "attn_implementation": model_args.attn_implementation,
                   "dtype": model_args.dtype}
    init_kwargs = {k: v for k, v in init_kwargs.items() if v not in (None, "main", "auto")}
    if init_kwargs:
        training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}

    train_dataset, eval_dataset = load_data(script_args)
    trainer = StreamedKTOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),  # None: deg_hf's default LoRA
    )
    trainer.train()
    trainer.save_model()  # adapter + deg.json + README card
    if eval_dataset is not None:
        trainer.log_metrics("eval", trainer.evaluate())
    if training_args.push_to_hub:
        trainer.push_to_hub()  # adapter, tokenizer, deg.json and card; never training_args.bin
    trainer.release_stream()


if __name__ == "__main__":
    main()

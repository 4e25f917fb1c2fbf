"""What every script in recipes/ shares: argument parsing with the defaults that make a bare run work
offline on CPU, and the dataset (the embedded view, or any Hub dataset)."""

from __future__ import annotations


def parse_args(config_class, recipe: str, argv=None):
    """``(script_args, training_args, model_args)`` from the command line and ``--config`` YAML.

    Defaults: the checkpoint's own dtype, no bf16 where the device has none, ``outputs/<recipe>``
    as output_dir, and the tiny embedded model when no ``--model_name_or_path`` is given."""
    import torch
    from trl import ModelConfig, ScriptArguments, TrlParser

    from deg_hf import assets

    parser = TrlParser((ScriptArguments, config_class, ModelConfig))
    parser.set_defaults(dtype="auto")  # load in the checkpoint's own dtype, not TRL's float32
    if not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        parser.set_defaults(bf16=False)  # TRL defaults to bf16, which a CPU-only machine refuses
    script_args, training_args, model_args = parser.parse_args_and_config(argv)
    if training_args.output_dir in (None, "trainer_output"):  # the TRL/transformers default
        training_args.output_dir = f"outputs/{recipe}"
    model_args.model_name_or_path = model_args.model_name_or_path or assets.tiny_model_path()
    init_kwargs = {"revision": model_args.model_revision, "attn_implementation": model_args.attn_implementation,
                   "dtype": model_args.dtype}
    init_kwargs = {k: v for k, v in init_kwargs.items() if v not in (None, "main", "auto")}
    if init_kwargs:
        training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}
    return script_args, training_args, model_args


def load_data(script_args, view: str):
    """``(train, eval or None)``: the embedded ``view`` when no ``--dataset_name`` is given."""
    from deg_hf import assets

    if script_args.dataset_name is None:
        return assets.tiny_dataset(view, "train"), assets.tiny_dataset(view, "test")
    from datasets import load_dataset

    data = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    return data[script_args.dataset_train_split], data.get(script_args.dataset_test_split)

"""Kahneman-Tversky Optimization (LoRA) with layers streamed from host memory.

KTO's KL term pairs each completion with another prompt of its micro-batch, so it needs
--per_device_train_batch_size >= 2.

    python recipes/kto.py                                   # tiny embedded model and data, CPU
    python recipes/kto.py --config recipes/configs/kto.yaml --max_steps 100
    python recipes/kto.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct \
        --dataset_name trl-lib/kto-mix-14k --use_peft --output_dir outputs/qwen-kto

With no --model_name_or_path the tiny model shipped in deg_hf is used; with no --dataset_name the
embedded "kto" view (prompt/completion/label). Without --use_peft deg_hf trains its default LoRA
adapter (streamed; with --stream_layers false every weight trains, as in TRL's script).
"""

from trl import get_peft_config

from deg_hf import StreamedKTOConfig, StreamedKTOTrainer
from deg_hf.recipe_utils import load_data, parse_args, print_summary, resume_from

RECIPE, VIEW = "kto", "kto"


def main(argv=None):
    script_args, training_args, model_args = parse_args(StreamedKTOConfig, RECIPE, argv)
    train_dataset, eval_dataset = load_data(script_args, VIEW)
    trainer = StreamedKTOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),  # None: deg_hf's default LoRA streamed, a full fine-tune resident
    )
    trainer.train(resume_from_checkpoint=resume_from(training_args))  # true: newest complete checkpoint
    trainer.save_model()  # adapter + deg.json + README card
    if eval_dataset is not None:
        trainer.log_metrics("eval", trainer.evaluate())
    if training_args.push_to_hub:
        trainer.push_to_hub()  # adapter, tokenizer, deg.json and card; never training_args.bin
    if script_args.summary:
        print_summary(trainer)  # table + OUTPUT_DIR/run.png
    trainer.release_stream()


if __name__ == "__main__":
    main()

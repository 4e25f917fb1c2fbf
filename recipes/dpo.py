"""Direct Preference Optimization (LoRA) with layers streamed from host memory.

The reference model is the same streamed base with the adapter disabled: no second copy is loaded.

    python recipes/dpo.py                                   # tiny embedded model and data, CPU
    python recipes/dpo.py --config recipes/configs/dpo.yaml --beta 0.2 --summary true
    python recipes/dpo.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct \
        --dataset_name trl-lib/ultrafeedback_binarized --use_peft --output_dir outputs/qwen-dpo

With no --model_name_or_path the tiny model shipped in deg_hf is used; with no --dataset_name the
embedded "preference" view (prompt/chosen/rejected). Without --use_peft deg_hf trains its default
LoRA adapter (streamed; with --stream_layers false every weight trains, as in TRL's script).
--summary measures held-out reward accuracy before and after training and ends with a summary table
and OUTPUT_DIR/run.png (`make demo`: dpo.yaml, --stream_buffers 1 --summary true).
"""

from trl import get_peft_config

from deg_hf import StreamedDPOConfig, StreamedDPOTrainer
from deg_hf.recipe_utils import load_data, parse_args, print_summary, resume_from, reward_accuracy

RECIPE, VIEW = "dpo", "preference"


def main(argv=None):
    script_args, training_args, model_args = parse_args(StreamedDPOConfig, RECIPE, argv)
    train_dataset, eval_dataset = load_data(script_args, VIEW)
    trainer = StreamedDPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=get_peft_config(model_args),  # None: deg_hf's default LoRA streamed, a full fine-tune resident
    )
    before = reward_accuracy(trainer) if script_args.summary else None  # untrained: 0.5, policy == reference
    trainer.train(resume_from_checkpoint=resume_from(training_args))  # true: newest complete checkpoint
    trainer.save_model()  # adapter + deg.json + README card
    if eval_dataset is not None:
        trainer.log_metrics("eval", trainer.evaluate())
    if training_args.push_to_hub:
        trainer.push_to_hub()  # adapter, tokenizer, deg.json and card; never training_args.bin
    if script_args.summary:  # table + OUTPUT_DIR/run.png, held-out reward accuracy before -> after
        print_summary(trainer, accuracy=(before, reward_accuracy(trainer)))
    trainer.release_stream()


if __name__ == "__main__":
    main()

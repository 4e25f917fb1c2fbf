"""SimPO (LoRA) with layers streamed from host memory, run by TRL's CPO trainer.

SimPOConfig defaults to loss_type="simpo", cpo_alpha=0, beta=2.0 and simpo_gamma=0.5 (the paper's).

    python recipes/simpo.py                                 # tiny embedded model and data, CPU
    python recipes/simpo.py --config recipes/configs/simpo.yaml --simpo_gamma 1.0
    python recipes/simpo.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct \
        --dataset_name trl-lib/ultrafeedback_binarized --use_peft --output_dir outputs/qwen-simpo

With no --model_name_or_path the tiny model shipped in deg_hf is used; with no --dataset_name the
embedded "preference" view (prompt/chosen/rejected). Without --use_peft deg_hf trains its default
LoRA adapter (streamed; with --stream_layers false every weight trains, as in TRL's script).
"""

from trl import get_peft_config

from deg_hf import SimPOConfig, StreamedSimPOTrainer
from deg_hf.recipe_utils import load_data, parse_args, print_summary, resume_from

RECIPE, VIEW = "simpo", "preference"


def main(argv=None):
    script_args, training_args, model_args = parse_args(SimPOConfig, RECIPE, argv)
    train_dataset, eval_dataset = load_data(script_args, VIEW)
    trainer = StreamedSimPOTrainer(
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

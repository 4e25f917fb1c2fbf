"""Runs training jobs for the fault tests (tests/test_faults.py), each in a forked child process.

    python tests/fault_runner.py PLAN.json RESULTS.json

The heavy imports (torch, transformers, TRL, deg_hf) happen once here; each job then runs in a
child forked from this process (nothing has run a torch kernel yet, so no thread pool is copied
half-initialised), and a child can be killed with SIGKILL, interrupted with SIGINT or hit a
file-size limit without the cost of a new interpreter. A job is::

    {"output_dir": ..., "resume": bool,
     "kill_at": fraction of the reference run's train() time at which the child SIGKILLs itself,
     "in_save": [step, "kill" | "double_sigint"]: inside the save of checkpoint-`step`, after its
                weights and optimizer are written: SIGKILL, or two SIGINTs (a double Ctrl-C),
     "fsize": [step, bytes]: RLIMIT_FSIZE set to bytes once optimizer step `step` is done}

A job with ``"timing": true`` is an uninterrupted run whose train() time scales the fractions of
the jobs after it (run it after a first job: the first child pays for warming the disk caches). RESULTS.json gets, per
job, how the child ended (exit code, or the signal that ended it) and its error message; what a
faulted job left behind is copied to OUTPUT_DIR.after-fault before the next job resumes it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from harness import sft_rows, trainer_kwargs  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

from deg_hf import StreamedSFTConfig, StreamedSFTTrainer  # noqa: E402

MAX_STEPS = 5


class FileSizeLimit(TrainerCallback):
    """From the end of optimizer step ``step`` on, no file may grow past ``limit`` bytes: the save
    of that step runs out of room part way, as on a disk that fills up."""

    def __init__(self, step: int, limit: int):
        self.step, self.limit = step, limit

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, resource.RLIM_INFINITY))


def build(model: str, job: dict) -> StreamedSFTTrainer:
    args = StreamedSFTConfig(**trainer_kwargs(
        job["output_dir"], max_steps=MAX_STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_length=32, save_strategy="steps", save_steps=1, logging_steps=1, learning_rate=5e-3))
    return StreamedSFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(sft_rows(16)),
        processing_class=AutoTokenizer.from_pretrained(model),
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"),
    )


def run_job(model: str, job: dict, train_seconds: float) -> None:
    torch.set_num_threads(1)
    trainer = build(model, job)
    if job.get("fsize"):
        trainer.add_callback(FileSizeLimit(*job["fsize"]))
    if job.get("kill_at") is not None:
        timer = threading.Timer(job["kill_at"] * train_seconds, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()
    if job.get("in_save"):
        step, action = job["in_save"]
        save_rng_state = trainer._save_rng_state

        def interrupted(output_dir):
            if trainer.state.global_step == step:
                os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGINT)
                if action == "double_sigint":
                    os.kill(os.getpid(), signal.SIGINT)
            return save_rng_state(output_dir)

        trainer._save_rng_state = interrupted
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if job.get("resume") else None)
    trainer.save_model()
    if job.get("timing"):
        with open(job["output_dir"] + ".seconds", "w") as fh:
            fh.write(str(time.perf_counter() - start))


def run_child(model: str, job: dict, train_seconds: float) -> dict:
    """Fork, run ``job`` in the child, wait: how the child ended, and its error when it raised."""
    error_file = job["output_dir"] + ".error"
    if os.path.exists(error_file):
        os.remove(error_file)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            run_job(model, job, train_seconds)
            code = 0
        except BaseException as exc:  # reported to the test: the type and message of what stopped the run
            try:
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                with open(error_file, "w") as fh:
                    fh.write(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            except BaseException:
                pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    result = {"output_dir": job["output_dir"], "exit": os.waitstatus_to_exitcode(status)}
    if os.path.exists(error_file):
        with open(error_file) as fh:
            result["error"] = fh.read()
    return result


def main(plan_path: str, results_path: str) -> None:
    with open(plan_path) as fh:
        plan = json.load(fh)
    results, train_seconds = [], 1.0
    for job in plan["jobs"]:
        result = run_child(plan["model"], job, train_seconds)
        # a run can outpace the timing run (the cores are shared): a moment it outlived is tried again,
        # earlier, in a fresh directory, so that every planned kill lands inside a run
        while job.get("kill_at") is not None and result["exit"] == 0 and job["kill_at"] > 0.05:
            shutil.rmtree(job["output_dir"])
            job = {**job, "kill_at": round(job["kill_at"] * 0.7, 3)}
            result = run_child(plan["model"], job, train_seconds)
        result["kill_at"] = job.get("kill_at")
        seconds = job["output_dir"] + ".seconds"
        if job.get("timing") and os.path.exists(seconds):
            with open(seconds) as fh:
                train_seconds = float(fh.read())
        if any(job.get(fault) for fault in ("kill_at", "in_save", "fsize")):
            # what the fault left behind, before the resume rewrites it
            shutil.copytree(job["output_dir"], job["output_dir"] + ".after-fault", symlinks=True)
        results.append(result)
    with open(results_path, "w") as fh:
        json.dump({"train_seconds": train_seconds, "jobs": results}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

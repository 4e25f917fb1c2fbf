"""StreamedKTOTrainer: TRL's ``KTOTrainer`` over a streamed base.

KTO's reference forward (and its KL forward) run through the trainer's own model with the adapter
disabled, so the reference is the same streamed base, as for DPO.

KTO's KL term is a batch-level quantity: the mean over the micro-batch of mismatched
(prompt, completion) log-ratios. When the memory plan runs a micro-batch in several parts, the KL
forwards (policy and reference, without gradients) run first over the whole micro-batch, one
planned part at a time (a part that runs out of memory there is halved), and every part uses the
concatenated values, so the parts add up to the unsplit loss.
"""

from __future__ import annotations

import torch
from trl import KTOTrainer

from deg_hf.trainers.mixin import StreamingSetupMixin


def _reference_adapters_on(model) -> bool:
    """The PEFT model runs as its reference: adapters disabled, or TRL's frozen "ref" adapter active."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            return bool(module.disable_adapters) or list(module.active_adapters) == ["ref"]
    return False


class StreamedKTOTrainer(StreamingSetupMixin, KTOTrainer):
    """A drop-in TRL ``KTOTrainer``.

    One row per example for the main forward plus one for the KL forward (a mismatched completion
    per example); a per-device batch of at least 2 (the KL term needs another prompt).
    """

    deg_task = "kto"
    deg_fused_lm_head = True
    deg_rows_per_example = 1
    deg_kl_rows_per_example = 1
    deg_min_batch = 2
    deg_config_class = "StreamedKTOConfig"
    deg_loss_unit = "examples"

    _deg_kl_cache: dict | None = None

    def _deg_before_parts(self, model, inputs, parts) -> None:
        if not self.calculate_KL:
            return
        from deg_hf.memory import batch as mb
        from deg_hf.memory.split_retry import is_oom

        batch = {k: (v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        queue = [list(p) for p in parts]
        done: list[tuple[list[int], dict]] = []
        while queue:
            idx = queue.pop(0)
            chunk = batch if idx == list(range(mb.n_examples(batch, False))) else mb.select(batch, idx, False)
            try:
                with self.deg_memory.part():
                    done.append((idx, self._deg_kl_logps(model, chunk)))
            except Exception as exc:
                if not is_oom(exc) or len(idx) < 2:
                    raise
                self.deg_engine.count_retry(exc)
                half = len(idx) // 2
                queue[:0] = [idx[:half], idx[half:]]
        order = torch.as_tensor([i for idx, _ in done for i in idx])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        self._deg_kl_cache = {
            key: torch.cat([values[key] for _, values in done])[inverse.to(done[0][1][key].device)]
            for key in done[0][1]
        }

    def _deg_kl_logps(self, model, batch) -> dict:
        """KL log-probs of ``batch``'s rows: with the adapter (key False) and, unless precomputed, without
        it (the reference, key True)."""
        from trl.trainer.utils import use_adapter

        out = {False: KTOTrainer._compute_kl_logps(self, model, batch)}
        if not self.precompute_ref_logps:
            with torch.no_grad():
                if self.ref_model is not None:  # a full fine-tune (resident): TRL's own reference model
                    out[True] = KTOTrainer._compute_kl_logps(self, self.ref_model, batch)
                else:
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                        out[True] = KTOTrainer._compute_kl_logps(self, self.model, batch)
        return out

    def _deg_after_parts(self) -> None:
        self._deg_kl_cache = None

    def _deg_part_inputs(self, part: dict, whole: dict) -> dict:
        if self._deg_kl_cache is not None and "ref_KL_logps" in whole:
            part = dict(part)
            part["ref_KL_logps"] = whole["ref_KL_logps"]  # the KL term is the whole micro-batch's
        return part

    def _compute_kl_logps(self, model, batch):
        if self._deg_kl_cache is None:
            return super()._compute_kl_logps(model, batch)
        if self.ref_model is not None:
            return self._deg_kl_cache[model is self.ref_model]
        return self._deg_kl_cache[_reference_adapters_on(model)]

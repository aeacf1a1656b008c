"""Validation on a held-out split: TorchTitan's Validator with HyMo's two adjustments.

- The reported loss is the main head's cross-entropy only (``MTPLoss.evaluating``), so it is
  comparable across MTP settings, and validation batches do not enter the training metrics.
- The MoE blocks count routed tokens in every forward; validation's counts are discarded so
  that they never reach the balancing bias (the bias, and an exact resume, depend on training
  batches only).
- HyMo's forward takes no attention masks; TorchTitan's Validator asks every model for them.
  With ``[hymo] document_masking`` (or ``validation_document_masking = "on"``) the batch's
  document boundaries go to the model instead, as in training (hymo_recipes/titan/documents.py),
  so the held-out loss is computed per document.
"""

from __future__ import annotations

from hymo_recipes.titan import documents
from hymo_recipes.titan.api import Validator
from hymo_recipes.titan.step_hooks import moe_modules


class HymoValidator(Validator):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._split_documents = documents.splitter(self.job_config, self.tokenizer, validation=True)

    def post_dataloading_process(self, input_dict, labels, model_parts):
        inputs = input_dict["input"]
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        if self._split_documents is not None:
            extra_inputs.update(self._split_documents(inputs))
        return inputs, labels, extra_inputs, {}

    def validate(self, model_parts, step: int) -> None:
        with self.loss_fn.evaluating():
            super().validate(model_parts, step)
        # The trainer validates after the step's optimizer hooks have consumed and zeroed the
        # counters, so zeroing them again drops exactly the validation forwards.
        for moe in moe_modules(model_parts):
            moe.reset_load_counters()


def build_hymo_validator(**kwargs) -> HymoValidator:
    return HymoValidator(**kwargs)

"""CausalLM: next-token pre-training of a LLaMA-style decoder, and sampling from it."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity
from typing_extensions import override

from ..models import DecoderLM, LayerConfig
from ..nn import reusing_inference_factors
from ..optim import OptimConfig
from .base import ComeraTask
from .checks import check_id_ranges

__all__ = ["CausalLM"]

IGNORE = -100
_GENERATION_ARGS = (
    "generate_max_new_tokens",
    "generate_top_k",
    "generate_temperature",
    "generate_seed",
    "print_samples",
)


class CausalLM(ComeraTask):
    """Cross-entropy of every next token; logs ``train/loss``, ``val/loss``, ``val/perplexity`` (``test/`` alike).

    Batches hold ``input_ids (B, T)`` and, optionally, ``labels (B, T)`` (the next token at every position,
    ``-100`` where there is none; :class:`~comera_lightning.data.CodeLMDataModule` packs them); without
    ``labels`` the inputs are shifted by one. ``predict`` continues each prompt of a batch's ``input_ids``
    with :meth:`generate` (the ``generate_*`` options; they are not saved with the checkpoint, so the
    command line of ``comera predict`` decides them) and returns, per prompt, the ids and, when the
    datamodule can ``decode``, the text (printed when ``print_samples``).

    Args:
        vocab_size: rows of the token embedding and outputs of the head; at least the tokenizer's size.
        optim, optimizer, lr_scheduler: see :class:`ComeraTask`.
        generate_max_new_tokens: tokens sampled per prompt in ``predict``.
        generate_top_k: sample among the ``k`` most likely tokens (None: all of them).
        generate_temperature: softmax temperature; ``0`` is greedy decoding.
        generate_seed: seed of the sampling in ``predict`` (per batch: ``seed + batch_idx``).
        print_samples: print prompt and continuation of every prompt in ``predict`` (global rank zero).
        model_kwargs: the decoder's architecture, see :class:`comera_lightning.models.DecoderLM`.
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        optim: OptimConfig = OptimConfig(),
        optimizer: dict[str, Any] | None = None,
        lr_scheduler: dict[str, Any] | None = None,
        generate_max_new_tokens: int = 64,
        generate_top_k: int | None = None,
        generate_temperature: float = 0.0,
        generate_seed: int = 0,
        print_samples: bool = True,
        **model_kwargs: Any,
    ) -> None:
        super().__init__(optim, optimizer, lr_scheduler)
        if generate_max_new_tokens < 0:
            raise ValueError(f"generate_max_new_tokens must be >= 0, got {generate_max_new_tokens}")
        if generate_top_k is not None and generate_top_k < 1:
            raise ValueError(f"generate_top_k must be >= 1 or None, got {generate_top_k}")
        if generate_temperature < 0:
            raise ValueError(f"generate_temperature must be >= 0, got {generate_temperature}")
        # sampling options belong to the command that samples, not to the trained model
        self.save_hyperparameters(ignore=list(_GENERATION_ARGS))
        self.vocab_size = vocab_size
        self.generate_max_new_tokens, self.generate_top_k = generate_max_new_tokens, generate_top_k
        self.generate_temperature, self.generate_seed = generate_temperature, generate_seed
        self.print_samples = print_samples
        LayerConfig.refuse_flat_options(model_kwargs)
        OptimConfig.refuse_flat_options(model_kwargs)
        self.model = DecoderLM(vocab_size=vocab_size, **model_kwargs)
        self.val_perplexity, self.test_perplexity = Perplexity(ignore_index=IGNORE), Perplexity(ignore_index=IGNORE)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.check_vocabulary(self.vocab_size)

    # ------------------------------------------------------------------ loss
    @staticmethod
    def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
        """Labels of an unpacked batch: ``input_ids`` shifted left by one, ``-100`` at the last position."""
        return F.pad(input_ids[:, 1:], (0, 1), value=IGNORE)

    def _logits_and_labels(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = batch["input_ids"]
        labels = batch.get("labels")
        labels = self.next_token_labels(ids) if labels is None else labels
        fix = (
            f"the model's vocabulary has {self.vocab_size} ids: set model.vocab_size to at least the tokenizer's "
            f"size (data.vocab_size), or use the tokenizer the model was built for"
        )
        # ignored positions read as id 0: a static shape, so the step stays capturable in a CUDA graph
        check_id_ranges(
            [
                ("a batch's input_ids", ids, self.vocab_size, fix),
                (
                    f"a batch's labels (besides {IGNORE}, the ignored positions)",
                    labels.masked_fill(labels == IGNORE, 0),
                    self.vocab_size,
                    fix,
                ),
            ]
        )
        return self.model(ids), labels

    @staticmethod
    def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, -2), labels.reshape(-1), ignore_index=IGNORE)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits, labels = self._logits_and_labels(batch)
        loss = self._cross_entropy(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def evaluate(self, batch: dict[str, torch.Tensor], stage: str) -> None:
        logits, labels = self._logits_and_labels(batch)
        tokens = int((labels != IGNORE).sum())
        if tokens == 0:
            return
        getattr(self, f"{stage}_loss").update(self._cross_entropy(logits, labels), weight=tokens)
        getattr(self, f"{stage}_perplexity").update(logits.float(), labels)

    @override
    def log_evaluation(self, stage: str) -> None:
        loss, perplexity = getattr(self, f"{stage}_loss"), getattr(self, f"{stage}_perplexity")
        if not perplexity.update_called:
            return
        self.log_dict({f"{stage}/loss": loss.compute(), f"{stage}/perplexity": perplexity.compute()}, prog_bar=True)
        loss.reset()
        perplexity.reset()

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        max_new_tokens: int,
        top_k: int | None = None,
        temperature: float = 1.0,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Continue prompts token by token; returns ``(B, P + new)`` ids, the prompts included.

        Args:
            prompt_ids: ``(B, P)`` or ``(P,)`` token ids (``P >= 1``).
            max_new_tokens: tokens to add.
            top_k: sample among the ``k`` most likely tokens; None: among all; ``1``: greedy.
            temperature: divides the logits before sampling; ``0`` (or ``top_k=1``) is greedy (argmax).
            eos_id: once a sequence emits it, it emits only ``eos_id``; generation stops when all have.
            generator: source of the sampling randomness (on the model's device).
            use_cache: keep each layer's keys and values (:class:`~comera_lightning.models.KVCache`), so a new
                token costs one position's work; ``False`` re-runs the whole sequence for every token (the same
                logits, the reference the cache is tested against).

        Each position attends to the ``max_len`` last tokens, a sliding window past the model's context (see
        :class:`~comera_lightning.models.DecoderLM`). Runs in eval mode and restores the previous mode.
        """
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        ids = prompt_ids.to(self.device).long()
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(
                f"prompt_ids must be (batch, prompt_len) with prompt_len >= 1, got shape {tuple(prompt_ids.shape)}"
            )
        was_training = self.model.training
        self.model.eval()
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        cache = self.model.new_cache() if use_cache else None
        try:
            # the weights cannot change between tokens: each TT layer checks its merged factors once per call
            with reusing_inference_factors(self.model):
                for step in range(max_new_tokens):
                    if cache is None:
                        hidden = self.model.hidden_states(ids)
                    else:
                        hidden = self.model.hidden_states(ids if step == 0 else ids[:, -1:], cache)
                    logits = self.model.head(hidden[:, -1]).float()
                    if temperature == 0 or top_k == 1:
                        token = logits.argmax(dim=-1)
                    else:
                        logits = logits / temperature
                        if top_k is not None and top_k < logits.shape[-1]:
                            kth = logits.topk(top_k, dim=-1).values[:, -1:]
                            logits = logits.masked_fill(logits < kth, float("-inf"))
                        token = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)
                    if eos_id is not None:
                        token = torch.where(finished, torch.full_like(token, eos_id), token)
                        finished |= token == eos_id
                    ids = torch.cat([ids, token.unsqueeze(1)], dim=1)
                    if eos_id is not None and bool(finished.all()):
                        break
        finally:
            self.model.train(was_training)
        return ids

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        """Continue every prompt of the batch; one dict per prompt: ``index``, ``prompt_ids``, ``generated_ids``
        and, when the datamodule has ``decode``, ``prompt`` and ``completion`` (text)."""
        prompts = batch["input_ids"]
        generator = torch.Generator(device=self.device).manual_seed(self.generate_seed + batch_idx)
        out = self.generate(
            prompts, self.generate_max_new_tokens, self.generate_top_k, self.generate_temperature, generator=generator
        )
        datamodule = self.attached_datamodule
        decode = getattr(datamodule, "decode", None)
        index = batch.get("index", torch.arange(len(prompts)))
        samples = []
        for row, (prompt, full) in enumerate(zip(prompts, out, strict=True)):
            sample: dict[str, Any] = {
                "index": int(index[row]),
                "prompt_ids": prompt.cpu(),
                "generated_ids": full[prompts.shape[1] :].cpu(),
            }
            if callable(decode):
                sample["prompt"], sample["completion"] = decode(sample["prompt_ids"]), decode(sample["generated_ids"])
            samples.append(sample)
        if (
            self.print_samples
            and "prompt" in (samples[0] if samples else {})
            and (self.attached_trainer is None or self.trainer.is_global_zero)
        ):
            for sample in samples:
                print(f"--- prompt {sample['index']}:\n{sample['prompt']}\n--- continuation:\n{sample['completion']}")
        return samples

"""``MaskedDiffusionLMPolicy``: a masked-diffusion language model behind the ``Policy`` protocol.

A step is a completion token, as for a causal LM, so the GRPO family, PPO clip, the KL estimators and the pair
losses run on it unchanged; what differs is ``log_prob``: the model has no exact sequence log-prob, so it is one of
the registered estimators of ``unialign.algos.masked_diffusion`` (``estimator``), computed on masks drawn from the
trajectory's own seeds. Old, reference and current log-probs of an update are therefore computed on the same masks
(the first on-policy ratio is exactly 1), whichever module scores them.

Prompts are encoded by the text package's ``PromptEncoder`` (chat template, system prompt, left padding), data and
rewards are the text scripts', and held-out evaluation is ``unialign.text.evaluate`` (it calls ``generate``).
Sampling is block decoding (``unialign.dlm.sampling``); the family row (``unialign.dlm.families``) gives the mask
token and where a position's logits are read.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch

from unialign.algos.masked_diffusion import (
    EstimatorOptions,
    MaskedSequences,
    get_log_prob_estimator,
    spg_bounds,
)
from unialign.dist import is_main_rank, unwrap
from unialign.dlm.families import Family, family_of, require_trust
from unialign.dlm.sampling import DiffusionSampling, block_decode
from unialign.hub import hub_error, require_hub
from unialign.policy import LossTerms, PolicyBase, ReferencePolicy, SamplingCopy
from unialign.text import prefix
from unialign.text.policy import load_model_options, prepare_model
from unialign.text.prompts import PromptEncoder
from unialign.types import PreferenceBatch, Trajectory
from unialign.weights import check_finite

#: the extra per-step term a policy loss may read (``LossRequest.terms``): SPG's upper bound beside the ELBO
TERMS = ("eubo",)


class MaskedDiffusionLMPolicy(PolicyBase, LossTerms, SamplingCopy):
    """Policy over a masked-diffusion LM. ``model`` may be wrapped (DDP / FSDP) by the trainer."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, family: Family,
                 sampling: DiffusionSampling | None = None, estimator: str = "elbo_mc",
                 estimator_options: EstimatorOptions | None = None, chat_template: str = "auto",
                 system_prompt: str | None = None, max_prompt_length: int | None = None,
                 max_rows_per_forward: int = 1024):
        """``estimator``: the registered log-prob estimator ``log_prob`` computes (``LOG_PROB_ESTIMATORS``),
        ``estimator_options`` its knobs; ``sampling``: block decoding (``DiffusionSampling``);
        ``max_rows_per_forward``: rows of masked copies scored per model call (memory)."""
        self.model, self.family = model, family
        self.prompt_encoder = PromptEncoder(tokenizer, chat_template, system_prompt, max_prompt_length)
        self.sampling = sampling or DiffusionSampling()
        self.estimator = get_log_prob_estimator(estimator).name
        self.estimator_options = estimator_options or EstimatorOptions()
        self.max_rows_per_forward = max_rows_per_forward
        self.mask_id = self._mask_id(tokenizer, family)
        self.last_forwards = 0  # forward passes of the last ``sample`` / ``generate`` (the benchmarks read it)
        self._frozen_copy: torch.nn.Module | None = None

    @staticmethod
    def _mask_id(tokenizer: Any, family: Family) -> int:
        token = tokenizer.mask_token or family.mask_token
        ids = tokenizer.convert_tokens_to_ids(token) if token else None
        if ids is None or ids == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no mask token ({family.name} models use {family.mask_token!r}); "
                             "a masked-diffusion LM needs one")
        return int(ids)

    @classmethod
    def from_pretrained(cls, name_or_path: str, trust_remote_code: bool = False, torch_dtype: str = "float32",
                        lora_rank: int = 0, lora_alpha: float | None = None,
                        lora_target_modules: list[str] | str | None = None, attn_implementation: str | None = None,
                        gradient_checkpointing: bool = False, **kwargs: Any) -> MaskedDiffusionLMPolicy:
        """Load with transformers: ``AutoModelForMaskedLM`` (native masked LMs), ``AutoModel`` with remote code for
        LLaDA / Dream / DiffuCoder, refused without ``trust_remote_code`` (one line saying why); LoRA, attention
        kernel and activation checkpointing as ``CausalLMPolicy.from_pretrained``'s."""
        from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoTokenizer, PretrainedConfig

        require_hub(name_or_path, "model")
        try:
            raw, _ = PretrainedConfig.get_config_dict(name_or_path)
        except (OSError, ValueError) as err:
            raise hub_error(name_or_path, err) from None
        family = family_of(SimpleNamespace(model_type=raw.get("model_type"), unialign_family=raw.get("unialign_family")),
                           name_or_path)
        require_trust(family, name_or_path, trust_remote_code)
        try:
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
            loader = AutoModel if family.remote_code else AutoModelForMaskedLM
            model = loader.from_pretrained(name_or_path, config=config, **load_model_options(
                name_or_path, torch_dtype, trust_remote_code, attn_implementation))
        except (OSError, ValueError) as err:
            raise hub_error(name_or_path, err) from None
        check_finite(model, name_or_path)
        model = prepare_model(model, lora_rank, lora_alpha, lora_target_modules or "all-linear",
                              gradient_checkpointing, task_type=None)
        sampling = kwargs.pop("sampling", None) or DiffusionSampling(
            **{**family.sampling, **raw.get("unialign_sampling", {})})
        return cls(model, tokenizer, family, sampling=sampling, **kwargs)

    # ---------------------------------------------------------------- prompts
    @property
    def tokenizer(self) -> Any:
        return self.prompt_encoder.tokenizer

    @property
    def system_prompt(self) -> str | None:
        return self.prompt_encoder.system_prompt

    @property
    def max_prompt_length(self) -> int | None:
        return self.prompt_encoder.max_prompt_length

    def is_templated(self, prompt: Any) -> bool:
        return self.prompt_encoder.is_templated(prompt)

    def format_prompt(self, prompt: Any) -> str:
        return self.prompt_encoder.format_prompt(prompt)

    @property
    def device(self) -> torch.device:
        return next(unwrap(self.model).parameters()).device

    @property
    def log_prob_estimator(self) -> str:
        """The estimator ``log_prob`` computes (an algorithm's ``log_prob_estimator`` must name it)."""
        return self.estimator

    # ---------------------------------------------------------------- the model's forward
    def _logits(self, model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                completion: torch.Tensor) -> torch.Tensor:
        """Logits [N, T, V] that predict the completion's tokens, read where the family's alignment says."""
        T = completion.shape[1]
        ids = torch.cat([prompt_ids, completion], dim=1)
        attention = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        inputs = {"input_ids": ids, "attention_mask": attention}
        if "position_ids" in self.family.inputs:
            inputs["position_ids"] = position_ids
        logits = model(**inputs).logits
        if self.family.alignment == "shifted":  # position i predicts token i + 1
            return logits[:, -T - 1:-1]
        return logits[:, -T:]

    def _score(self, model: torch.nn.Module, prompt_mask: torch.Tensor, targets: torch.Tensor):
        """The estimators' ``score`` over ``model`` (``unialign.algos.masked_diffusion.Score``), in chunks of at
        most ``max_rows_per_forward`` rows."""
        temperature = max(self.sampling.temperature, 1e-6)

        def score(noisy_prompt: torch.Tensor, noisy_completion: torch.Tensor, replicas: int) -> torch.Tensor:
            mask = prompt_mask.repeat(replicas, 1)
            tgt = targets.repeat(replicas, 1)
            out = []
            for lo in range(0, len(noisy_completion), self.max_rows_per_forward):
                hi = lo + self.max_rows_per_forward
                logits = self._logits(model, noisy_prompt[lo:hi], mask[lo:hi], noisy_completion[lo:hi]).float()
                logp = torch.log_softmax(logits / temperature, dim=-1)
                out.append(logp.gather(-1, tgt[lo:hi].unsqueeze(-1)).squeeze(-1))
            return torch.cat(out)
        return score

    def _sequences(self, payload: dict[str, Any]) -> tuple[MaskedSequences, torch.Tensor]:
        prompt_ids, prompt_mask = prefix.right_align(payload["prompt_ids"], payload["prompt_mask"])
        seq = MaskedSequences(prompt_ids, payload["completion_ids"], payload["mask_seed"].cpu(), self.mask_id,
                              payload.get("step_map"), prompt_mask)
        return seq, prompt_mask

    def _estimate(self, model: torch.nn.Module, payload: dict[str, Any], estimator: str | None = None,
                  sign_B: torch.Tensor | None = None) -> torch.Tensor:
        seq, prompt_mask = self._sequences(payload)
        fn = get_log_prob_estimator(estimator or self.estimator).fn
        return fn(self._score(model, prompt_mask, seq.completion_ids_B_T), seq, self.estimator_options, sign_B)

    # ---------------------------------------------------------------- sampling
    def _decode(self, model: torch.nn.Module, prompts: list[Any], greedy: bool,
                generator: torch.Generator | None = None) -> dict[str, Any]:
        enc = self.prompt_encoder.encode(prompts, self.device)
        prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"]
        completion, step_map, forwards = block_decode(
            lambda x: self._logits(model, prompt_ids, prompt_mask, x), len(prompts), self.mask_id, self.sampling,
            greedy=greedy, device=self.device, generator=generator)
        self.last_forwards = forwards
        eos = completion == self.tokenizer.eos_token_id
        first = torch.where(eos.any(-1), eos.float().argmax(-1), torch.full_like(eos[:, 0], completion.shape[1],
                                                                                   dtype=torch.long))
        positions = torch.arange(completion.shape[1], device=completion.device)
        completion_mask = (positions <= first.unsqueeze(-1)).long()      # up to and including the first EOS (d1)
        texts = [self.tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
                 for row, n in zip(completion, first.tolist())]
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion,
                "completion_mask": completion_mask, "step_map": step_map, "truncated": ~eos.any(-1), "texts": texts}

    @torch.no_grad()
    def generate(self, prompts: list[Any], greedy: bool = False, max_new_tokens: int | None = None,
                 model: torch.nn.Module | None = None) -> dict[str, Any]:
        """Block-decoded completions (``greedy``: argmax draws, low-confidence commits); ids, masks, step map,
        truncation flags and texts. ``max_new_tokens`` is the block's ``gen_length`` and cannot change per call."""
        if max_new_tokens is not None and max_new_tokens != self.sampling.gen_length:
            raise ValueError(f"a masked-diffusion policy generates gen_length={self.sampling.gen_length} tokens, "
                             f"not max_new_tokens={max_new_tokens}")
        return self._decode(unwrap(model if model is not None else self.model), prompts, greedy)

    def sample(self, prompts: list[Any], generator: torch.Generator | None = None,
               record_logp: bool = True) -> Trajectory:
        """One block-decoded completion per prompt; the payload keeps the tokens, the ``step_map`` and one
        ``mask_seed`` per sample, from which every later ``log_prob`` of this trajectory draws its masks. Every draw
        comes from ``generator`` when given, else from torch's global RNG (which the trainer seeds and checkpoints)."""
        with torch.no_grad():
            g = self._decode(unwrap(self.model), prompts, False, generator)
        traj = self._trajectory(prompts, g, generator)
        if record_logp:
            with torch.no_grad():
                traj.old_logp_B_T = self._estimate(unwrap(self.model), traj.payload) * traj.mask_B_T
        return traj

    @staticmethod
    def _trajectory(prompts: list[Any], g: dict[str, Any], generator: torch.Generator | None = None) -> Trajectory:
        """A decoding's trajectory (no log-probs yet), with one mask seed per sample from ``generator`` (default
        torch's global RNG)."""
        payload = {k: g[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "step_map")}
        payload["mask_seed"] = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator,
                                             device=generator.device if generator is not None else "cpu").cpu()
        return Trajectory(prompts=list(prompts), completions=g["texts"], mask_B_T=g["completion_mask"].float(),
                          old_logp_B_T=None, truncated_B=g["truncated"].cpu(), payload=payload)

    # ---------------------------------------------------------------- log-probs
    def _log_prob(self, model: torch.nn.Module, trajectory: Trajectory, with_entropy: bool):
        """``log_prob`` / ``log_prob_and_entropy`` on ``model`` (the reference's form). The entropy is not
        estimated (zeros: an entropy bonus has nothing to act on)."""
        mask = trajectory.mask_B_T
        logp = self._estimate(model, trajectory.payload) * mask.to(self.device)
        return (logp, torch.zeros_like(logp)) if with_entropy else logp

    def log_prob(self, trajectory: Trajectory) -> torch.Tensor:
        """The estimator's differentiable ``logp_B_T`` on the trajectory's masks (0 where masked)."""
        return self._log_prob(self.model, trajectory, False)

    def log_prob_and_entropy(self, trajectory: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
        return self._log_prob(self.model, trajectory, True)

    def prepare_terms(self, names: tuple[str, ...]) -> None:
        """``LossTerms.prepare_terms``: nothing to record at sampling; ValueError for a term it lacks."""
        unknown = sorted(set(names) - set(TERMS))
        if unknown:
            raise ValueError(f"a masked-diffusion policy computes the terms {list(TERMS)}; asked for {unknown}")

    def log_prob_terms(self, trajectory: Trajectory, names: tuple[str, ...], with_kl: bool = False):
        """``LossTerms``: the log-probs and, for "eubo", SPG's upper bound from the same forwards (the log-probs
        are then SPG's lower bound, whatever ``estimator`` is)."""
        unknown = sorted(set(names) - set(TERMS))
        if unknown or with_kl:
            raise ValueError(f"a masked-diffusion policy computes the terms {list(TERMS)} and no closed-form KL; "
                             f"asked for {unknown or 'a KL'}")
        seq, prompt_mask = self._sequences(trajectory.payload)
        elbo, eubo = spg_bounds(self._score(self.model, prompt_mask, seq.completion_ids_B_T), seq,
                                self.estimator_options)
        mask = trajectory.mask_B_T.to(elbo.device)
        return elbo * mask, torch.zeros_like(elbo), None, {"eubo": eubo * mask}

    # ---------------------------------------------------------------- preference pairs (VRPO)
    def preference_batch(self, rows: list[dict[str, Any]], max_length: int | None = None) -> PreferenceBatch:
        """Pairs as one completion block per side (each completion + EOS, EOS-filled to a common length, as the
        model was trained), with one mask seed per pair, shared by its two sides and by the reference: VRPO's
        antithetic sampling (Zhu et al. 2025, arXiv 2505.19223)."""
        from unialign.text.preference import completion_text

        enc = self.prompt_encoder.encode([r["prompt"] for r in rows], self.device)
        eos = self.tokenizer.eos_token_id
        ids = [[self.tokenizer.encode(completion_text(r[k]), add_special_tokens=False) + [eos]
                for r in rows] for k in ("chosen", "rejected")]
        width = max(len(x) for side in ids for x in side)
        if max_length is not None:
            width = min(width, max_length)
        seeds = torch.randint(0, 2**31 - 1, (len(rows),))
        sides = []
        for side in ids:
            block = torch.tensor([(x + [eos] * width)[:width] for x in side], device=self.device)
            lengths = torch.tensor([min(len(x), width) for x in side], device=self.device)
            mask = (torch.arange(width, device=self.device) < lengths.unsqueeze(-1)).long()
            sides.append({"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"],
                          "completion_ids": block, "completion_mask": mask, "mask_seed": seeds})
        return PreferenceBatch(prompts=[r["prompt"] for r in rows], chosen=sides[0], rejected=sides[1],
                               chosen_length_B=sides[0]["completion_mask"].sum(-1).float())

    def sequence_log_prob(self, batch: PreferenceBatch, length_normalize: bool = False):
        return self._sequence_log_prob(self.model, batch, length_normalize)

    def completion_log_prob(self, side: dict[str, Any]) -> torch.Tensor:
        """Per-token terms [B, T] of the estimator's log-likelihood of one side of a ``preference_batch``, 0 where
        padded: their sum is the sequence's (a lower bound for the ELBO estimators), so minus it is masked-diffusion
        SFT's loss (LLaDA's: the masked tokens' cross-entropy weighted 1 / t)."""
        mask = side["completion_mask"].to(self.device).float()
        return self._estimate(self.model, side) * mask

    def _sequence_log_prob(self, model: torch.nn.Module, batch: PreferenceBatch, length_normalize: bool):
        """The estimator's sequence log-likelihood of each side, [B] each, on the pair's shared masks."""
        out = []
        for side in (batch.chosen, batch.rejected):
            mask = side["completion_mask"].to(self.device).float()
            total = (self._estimate(model, side) * mask).sum(-1)
            out.append(total / mask.sum(-1).clamp(min=1) if length_normalize else total)
        return out[0], out[1]

    # ---------------------------------------------------------------- reference, params, io
    def reference(self) -> ReferencePolicy:
        """Adapters disabled when the model is a PEFT model, else a frozen copy made once."""
        base = unwrap(self.model)
        if hasattr(base, "disable_adapter"):
            return ReferencePolicy(self, base, base.disable_adapter)
        if self._frozen_copy is None:
            self._frozen_copy = copy.deepcopy(base).eval().requires_grad_(False)
        return ReferencePolicy(self, self._frozen_copy)

    def sampling_view(self, model: torch.nn.Module) -> MaskedDiffusionLMPolicy:
        """``SamplingCopy``: this policy block-decoding from ``model`` (a frozen copy of the trained module) with its
        own tokenizer (a fast tokenizer is not safe to call from two threads); the sampling settings copied as they
        are now."""
        view = copy.copy(self)
        view.model = model
        view.prompt_encoder = copy.deepcopy(self.prompt_encoder)
        view._frozen_copy = None
        return view

    def _sample(self, model: torch.nn.Module, prompts: list[Any], generator: torch.Generator | None = None):
        g = self._decode(model, prompts, greedy=False)
        return self._trajectory(prompts, g)

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        return [p for p in unwrap(self.model).parameters() if p.requires_grad]

    def save(self, path: str) -> None:
        """``save_pretrained`` of the model (or adapters) and tokenizer, loadable by stock transformers."""
        if not is_main_rank():
            return
        unwrap(self.model).save_pretrained(path)
        self.tokenizer.save_pretrained(path)


"""The scripts' named recipes (``--preset NAME``) as data: hub models with their papers' or the peers' settings.
Every one loads real weights, so offline each fails within seconds naming what it cannot reach. Each script's
config holds its table as ``PRESETS``."""

from __future__ import annotations

from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "image" / "prompts"
GENEVAL_PROMPTS = str(PROMPTS_DIR / "geneval_metadata.jsonl")  # GenEval's .jsonl format, a few rows of each tag
OCR_PROMPTS = str(PROMPTS_DIR / "ocr_prompts.txt")              # Flow-GRPO's OCR format: the target in quotes

# ----------------------------------------------------------------------------- text
SYSTEM_GSM8K = ("Solve the problem step by step. End your answer with a final line of the form "
                "'#### <number>'.")

GRPO_MATH: dict[str, dict] = {
    # verl / TRL-style recipe for Qwen2.5-0.5B-Instruct on GSM8K (one GPU)
    "qwen2.5-0.5b-gsm8k": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="openai/gsm8k", dataset_config="main",
        system_prompt=SYSTEM_GSM8K, chat_template="always", max_new_tokens=512, temperature=1.0, learning_rate=1e-6, beta=0.0,
        prompts_per_step=32, num_generations=8, micro_batch_size=16, max_steps=500, num_eval=1319,
        torch_dtype="bfloat16", warmup_steps=10, lr_scheduler_type="constant", eval_batch_size=64,
        output_dir="outputs/grpo_qwen_gsm8k"),
    # masked-diffusion LMs (unialign.dlm; docs/dlm.md). d1's diffu-GRPO on LLaDA-8B-Instruct (dllm-reasoning/d1,
    # GSM8K: 256 tokens in blocks of 32, 128 steps, LoRA rank 128, lr 3e-6, 6 samples per prompt, mu 12, beta 0.04);
    # its modelling code is on the Hub: refused without --trust_remote_code.
    "llada-8b-instruct-gsm8k": dict(
        model_name_or_path="GSAI-ML/LLaDA-8B-Instruct", dlm_family="llada", algorithm="diffu_grpo",
        dataset_name="openai/gsm8k", dataset_config="main", system_prompt=SYSTEM_GSM8K, chat_template="always",
        gen_length=256, block_length=32, diffusion_steps=128, beta=0.04, lora_rank=128, learning_rate=3e-6,
        num_generations=6, prompts_per_step=16, micro_batch_size=6, max_steps=500, num_eval=1319, eval_batch_size=16,
        torch_dtype="bfloat16", warmup_steps=0, lr_scheduler_type="constant", output_dir="outputs/d1_llada_gsm8k"),
    # DiffuCoder's coupled-GRPO (apple/ml-diffucoder) on Dream-7B-Instruct: one block of 256 tokens, 128 steps,
    # 10 samples per prompt, lr 1e-6, no KL; remote code as for LLaDA.
    "dream-7b-coupled": dict(
        model_name_or_path="Dream-org/Dream-v0-Instruct-7B", dlm_family="dream", algorithm="coupled_grpo",
        dataset_name="openai/gsm8k", dataset_config="main", system_prompt=SYSTEM_GSM8K, chat_template="always",
        gen_length=256, block_length=256, diffusion_steps=128, beta=0.0, learning_rate=1e-6, num_generations=10,
        prompts_per_step=16, micro_batch_size=10, max_steps=500, num_eval=1319, eval_batch_size=16,
        torch_dtype="bfloat16", warmup_steps=0, lr_scheduler_type="constant", output_dir="outputs/coupled_dream_gsm8k"),
    # A native masked-diffusion chat model (dLLM's ModernBERT-large-chat-v0, ZHZisZZ/dllm): AutoModelForMaskedLM,
    # no remote code; GRPO on the ELBO.
    "modernbert-chat-gsm8k": dict(
        model_name_or_path="dllm-collection/ModernBERT-large-chat-v0", dlm_family="modernbert",
        dataset_name="openai/gsm8k", dataset_config="main", system_prompt=SYSTEM_GSM8K, chat_template="always",
        gen_length=256, block_length=32, diffusion_steps=128, beta=0.0, learning_rate=1e-6, num_generations=8,
        prompts_per_step=16, micro_batch_size=16, max_steps=500, num_eval=1319, eval_batch_size=32,
        torch_dtype="bfloat16", warmup_steps=0, lr_scheduler_type="constant", output_dir="outputs/grpo_modernbert_gsm8k"),
}

SFT: dict[str, dict] = {
    # TRL's SFT recipe shape on GSM8K's worked answers (TRL's lr 2e-5, linear decay): the start of an RL recipe
    "qwen2.5-0.5b-gsm8k": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B", dataset_name="openai/gsm8k", dataset_config="main",
        chat_template="always", learning_rate=2e-5, lr_scheduler_type="linear", warmup_steps=20, batch_size=32,
        micro_batch_size=8, max_steps=700, num_eval=256, torch_dtype="bfloat16", gradient_checkpointing=True,
        output_dir="outputs/sft_qwen_gsm8k"),
}

PPO_RLHF: dict[str, dict] = {
    "qwen2.5-0.5b-rm": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="openai/gsm8k", dataset_config="main",
        max_new_tokens=256, learning_rate=1e-6, beta=0.05, kl_target=6.0, prompts_per_step=64, micro_batch_size=8,
        max_steps=300, torch_dtype="bfloat16", output_dir="outputs/ppo_qwen"),
}


GEOMETRY_PROMPT = ("{content} You FIRST think about the reasoning process as an internal monologue and then provide "
                   "the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
                   "answer MUST BE put in \\boxed{}.")

GRPO_VISION: dict[str, dict] = {
    # EasyR1's examples/qwen2_5_vl_3b_geo3k_grpo.sh (hiyouga/EasyR1): Qwen2.5-VL-3B-Instruct on geometry3k
    "qwen2.5-vl-3b-geometry3k": dict(
        model_name_or_path="Qwen/Qwen2.5-VL-3B-Instruct", dataset_name="hiyouga/geometry3k", prompt_column="problem",
        prompt_template=GEOMETRY_PROMPT,
        eval_split="test", reward_funcs="math_accuracy", max_new_tokens=2048, max_prompt_length=2048,
        max_pixels=1003520, min_pixels=262144, learning_rate=1e-6, beta=0.01, num_generations=5,
        prompts_per_step=128, micro_batch_size=16, max_steps=100, torch_dtype="bfloat16", warmup_steps=0,
        lr_scheduler_type="constant", num_eval=601, eval_batch_size=16, freeze_vision=True,
        output_dir="outputs/grpo_qwen2.5_vl_geo3k"),
}


DPO_TEXT: dict[str, dict] = {
    "qwen2.5-0.5b-ultrafeedback": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="trl-lib/ultrafeedback_binarized",
        rpo_alpha=0.0, learning_rate=5e-7, batch_size=64, micro_batch_size=4, max_steps=1000, torch_dtype="bfloat16",
        warmup_steps=50, num_eval=512, output_dir="outputs/dpo_qwen_ultrafeedback"),
}


REWARD_MODEL: dict[str, dict] = {
    "qwen2.5-0.5b-ultrafeedback": dict(
        model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", dataset_name="trl-lib/ultrafeedback_binarized",
        learning_rate=1e-5, batch_size=32, micro_batch_size=4, max_steps=1000, max_length=1024,
        torch_dtype="bfloat16", output_dir="outputs/rm_qwen_ultrafeedback"),
}


# ----------------------------------------------------------------------------- images
GRPO_IMAGE: dict[str, dict] = {
    # SD1.5, CLIP score on a prompt file, LoRA; the Flow-GRPO knobs that carry over to a DDIM UNet
    # (group of 16, clip 1e-4 on mean-reduced step log-probs, closed-form KL at beta 0.04)
    "sd15-clip": dict(
        model_name_or_path="runwayml/stable-diffusion-v1-5", prompt_set="animals", reward_funcs="clip_score", num_steps=20,
        guidance_scale=4.5, eta=1.0, resolution=512, lora_rank=32, learning_rate=3e-4, prompts_per_step=8,
        num_generations=16, micro_batch_size=4, train_chunk_size=4, max_steps=300, num_eval=64, torch_dtype="float16",
        timestep_fraction=0.5, num_mini_batches=1, epsilon=1e-4, beta=0.04, eval_steps=50, num_threads=0,
        output_dir="outputs/grpo_sd15_clip"),
    # Flow-GRPO on SD3.5-Medium (Liu et al. 2025, arXiv 2505.05470; yifan123/flow_grpo config/grpo.py, geneval
    # configs): 10 SDE steps at 512 px, CFG 4.5, noise level 0.7, groups of 24, LoRA r32 / alpha 64 on the attention
    # projections, lr 3e-4, the flow_grpo preset (clip 1e-4, advantages +-5, batch std, beta 0.04 on its own KL).
    # GenEval's verifier in process (unialign/rewards/geneval.py: OWLv2 + CLIP colours instead of Flow-GRPO's
    # Mask2Former server), the dense score as the reward, the strict verdict as held-out fidelity. The prompts:
    # a few GenEval-format rows shipped as an example; give Flow-GRPO's dataset/geneval/train_metadata.jsonl
    # (or GenEval's evaluation_metadata.jsonl) with --prompt_set.
    "sd3.5-medium-geneval": dict(
        model_name_or_path="stabilityai/stable-diffusion-3.5-medium", model_family="sd3", prompt_set=GENEVAL_PROMPTS,
        reward_funcs="geneval", algorithm="flow_grpo", num_steps=10, guidance_scale=4.5, noise_level=0.7, sde_type="sde",
        sde_window_size=0, sde_window_range=None,
        resolution=512, max_sequence_length=128, lora_rank=32, lora_alpha=64.0, learning_rate=3e-4,
        lr_scheduler_type="constant", prompts_per_step=4, num_generations=24, num_mini_batches=2, micro_batch_size=4,
        train_chunk_size=4, sample_batch_size=8, max_steps=1000, num_eval=64, eval_steps=60, torch_dtype="bfloat16",
        num_threads=0, output_dir="outputs/grpo_sd35m_geneval"),
    # SD3.5-M with the forward-process methods' GenEval settings, CFG-free (both papers): AWM (scxue/
    # advantage_weighted_matching config/dgx_awm.py: 14 solver steps, 6 pairs per image, ghuber, lr 3e-4, LoRA
    # r32 / a64, groups of 24, one optimizer step per batch, KL 0.001; its SA-Solver collection is Euler here) and
    # DiffusionNFT (NVlabs/DiffusionNFT config/nft.py: 10 steps, 9 pairs, beta 1, old policy decay min(0.001 s,
    # 0.5); its DPM2 collection is Euler here). GenEval as above. The papers' KL and NFT beta are set here, not left
    # to ALGORITHM_DEFAULTS (the embedded world's).
    **{f"sd3.5-medium-geneval-{algo}": dict(
        model_name_or_path="stabilityai/stable-diffusion-3.5-medium", model_family="sd3", prompt_set=GENEVAL_PROMPTS,
        reward_funcs="geneval", algorithm=algo, beta=beta, nft_beta=nft_beta, num_steps=steps, guidance_scale=1.0,
        resolution=512, max_sequence_length=128, lora_rank=32, lora_alpha=64.0, learning_rate=3e-4,
        lr_scheduler_type="constant", weight_decay=1e-4, prompts_per_step=4, num_generations=24, num_mini_batches=1,
        micro_batch_size=micro, train_chunk_size=0, sample_batch_size=8, max_steps=1000, num_eval=64, eval_steps=50,
        torch_dtype="bfloat16", num_threads=0, output_dir=f"outputs/{algo}_sd35m_geneval")
       for algo, steps, micro, beta, nft_beta in (("awm", 14, 3, 0.001, None), ("nft", 10, 9, 1e-4, 1.0))},
    # DGPO on SD3.5-M GenEval (Luo-Yihong/DGPO config/dgpo_wocfg.py geneval_sd3_4gpu): 10 CFG-free steps (its DPM
    # solver is Euler here), groups of 16 (24 "for better performance"), lr 3e-4, the dgpo preset (beta_dpo 100, clip
    # 1e-3 against a moving average decayed by min(0.001 step, 0.3), KL 0.02, K = 4 pairs from the noisiest half:
    # trunc_steps 4 of 10; set here, not left to ALGORITHM_DEFAULTS, the embedded world's); the loss reads whole
    # groups, so a micro-batch is one group.
    "sd3.5-medium-geneval-dgpo": dict(
        model_name_or_path="stabilityai/stable-diffusion-3.5-medium", model_family="sd3", prompt_set=GENEVAL_PROMPTS,
        reward_funcs="geneval", algorithm="dgpo", beta=0.02, epsilon=1e-3, train_timesteps=4, forward_fraction=0.5,
        old_policy_decay="awm", num_steps=10, guidance_scale=1.0, resolution=512,
        max_sequence_length=128, lora_rank=32, lora_alpha=64.0, learning_rate=3e-4, lr_scheduler_type="constant",
        prompts_per_step=4, num_generations=16, num_mini_batches=1, micro_batch_size=16, train_chunk_size=0,
        sample_batch_size=16, max_steps=1000, num_eval=64, eval_steps=60, torch_dtype="bfloat16", num_threads=0,
        output_dir="outputs/dgpo_sd35m_geneval"),
    # GRPO-Guard and Flow-DPPO on the Flow-GRPO GenEval recipe above, with verl-omni's trust settings
    # (examples/grpoguard_trainer, examples/flowdppo_trainer: clip 2e-6 on RatioNorm's ratio; KL mask 1e-5; no KL;
    # two mini-batches per batch, so the second update is off-policy and the trust region acts)
    **{f"sd3.5-medium-geneval-{algo}": dict(
        model_name_or_path="stabilityai/stable-diffusion-3.5-medium", model_family="sd3", prompt_set=GENEVAL_PROMPTS,
        reward_funcs="geneval", algorithm=algo, beta=0.0, num_steps=10, guidance_scale=4.5, noise_level=0.7,
        sde_type="sde", sde_window_size=0, sde_window_range=None, resolution=512, max_sequence_length=128,
        lora_rank=32, lora_alpha=64.0, learning_rate=3e-4, lr_scheduler_type="constant", prompts_per_step=4,
        num_generations=24, num_mini_batches=2, micro_batch_size=4, train_chunk_size=4, sample_batch_size=8,
        max_steps=1000, num_eval=64, eval_steps=60, torch_dtype="bfloat16", num_threads=0,
        output_dir=f"outputs/{algo}_sd35m_geneval") for algo in ("grpo_guard", "flow_dppo")},
    # Flow-GRPO's text rendering (config/grpo.py general_ocr_sd3): the GenEval recipe with the OCR reward
    # (unialign/rewards/ocr.py, PP-OCRv4 through the ocr extra) on prompts quoting the text to render; give
    # Flow-GRPO's dataset/ocr/train.txt with --prompt_set.
    "sd3.5-medium-ocr": dict(
        model_name_or_path="stabilityai/stable-diffusion-3.5-medium", model_family="sd3", prompt_set=OCR_PROMPTS,
        reward_funcs="ocr", algorithm="flow_grpo", num_steps=10, guidance_scale=4.5, noise_level=0.7, sde_type="sde",
        sde_window_size=0, sde_window_range=None, resolution=512, max_sequence_length=128, lora_rank=32,
        lora_alpha=64.0, learning_rate=3e-4, lr_scheduler_type="constant", prompts_per_step=4, num_generations=24,
        num_mini_batches=2, micro_batch_size=4, train_chunk_size=4, sample_batch_size=8, max_steps=1000, num_eval=64,
        eval_steps=60, torch_dtype="bfloat16", num_threads=0, output_dir="outputs/grpo_sd35m_ocr"),
    # FLUX.1-dev on PickScore (flow_grpo config/grpo.py pickscore_flux; DanceGRPO's FLUX runs (XueZeyue/DanceGRPO)
    # share the group / clip / advantage-clip choices but use a constant-eta SDE and HPS): 6 SDE steps at 512 px,
    # guidance embedding 3.5 (no CFG), groups of 24, T5 512 tokens, beta 0.01 (PickScore's); PickScore on its published
    # scale (Flow-GRPO divides by 26, which normalised advantages do not see).
    "flux.1-dev-pickscore": dict(
        model_name_or_path="black-forest-labs/FLUX.1-dev", model_family="flux", prompt_set="animals",
        reward_funcs="pickscore", algorithm="flow_grpo", beta=0.01, num_steps=6, guidance_scale=3.5, noise_level=0.7,
        sde_type="sde", sde_window_size=0, sde_window_range=None, resolution=512, max_sequence_length=512, lora_rank=32,
        lora_alpha=64.0, learning_rate=3e-4,
        lr_scheduler_type="constant", prompts_per_step=4, num_generations=24, num_mini_batches=2, micro_batch_size=4,
        train_chunk_size=4, sample_batch_size=8, max_steps=1000, num_eval=64, eval_steps=60, torch_dtype="bfloat16",
        num_threads=0, output_dir="outputs/grpo_flux_pickscore"),
    # Z-Image-Turbo (Tongyi-MAI, the distilled Z-Image; diffusers' ZImagePipeline, unialign.image.zimage) on
    # PickScore with the FLUX recipe above: its stock sampling (9 steps, no CFG: its g = 0 is guidance_scale 1
    # here), Qwen3 prompts of up to 512 tokens, LoRA r32 / a64 on the attention projections.
    "z-image-turbo-pickscore": dict(
        model_name_or_path="Tongyi-MAI/Z-Image-Turbo", model_family="zimage", prompt_set="animals",
        reward_funcs="pickscore", algorithm="flow_grpo", beta=0.01, num_steps=9, guidance_scale=1.0, noise_level=0.7,
        sde_type="sde", sde_window_size=0, sde_window_range=None, resolution=512, max_sequence_length=512, lora_rank=32,
        lora_alpha=64.0, learning_rate=3e-4, lr_scheduler_type="constant", prompts_per_step=4, num_generations=24,
        num_mini_batches=2, micro_batch_size=4, train_chunk_size=4, sample_batch_size=8, max_steps=1000, num_eval=64,
        eval_steps=60, torch_dtype="bfloat16", num_threads=0, output_dir="outputs/grpo_zimage_pickscore"),
    # Wan 2.1 T2V 1.3B (diffusers' WanPipeline, unialign.image.wan) on PickScore scored on every frame, with
    # Flow-Factory's Wan 2.1 recipe (X-GenGroup/Flow-Factory examples/grpo/*/wan21/t2v.yaml: 256 px, 5 frames, 10
    # steps, w 5, flow shift 3 (the folder's own), eta 0.9 on one SDE step drawn from steps 1-3, groups of 16, clip
    # 1e-4, advantages clipped at 5, no KL; its CLIP + PickScore pair is PickScore alone here) and the Flow-GRPO
    # LoRA (r32 / a64, lr 3e-4; Flow-Factory's example trains all weights). DanceGRPO's Wan runs
    # (XueZeyue/DanceGRPO; CodeGoat24/Pref-GRPO scripts/finetune_prefgrpo_wan_2_1.sh) use 512 px, 49 frames,
    # 50 steps at eta 0.7, timestep_fraction 0.6, shift 3, clip 1e-4, w 5: --resolution 512 --num_frames 49 ...
    "wan2.1-t2v-1.3b-pickscore": dict(
        model_name_or_path="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", model_family="wan", prompt_set="animals",
        reward_funcs="pickscore", frame_reduction="mean", algorithm="flow_grpo", beta=0.0, num_steps=10,
        guidance_scale=5.0, noise_level=0.9, sde_type="sde", sde_window_size=1, sde_window_range="1,4",
        resolution=256, num_frames=5, max_sequence_length=512, lora_rank=32, lora_alpha=64.0, learning_rate=3e-4,
        lr_scheduler_type="constant", prompts_per_step=3, num_generations=16, num_mini_batches=2, micro_batch_size=4,
        train_chunk_size=4, sample_batch_size=8, max_steps=1000, num_eval=32, eval_steps=20, torch_dtype="bfloat16",
        num_threads=0, output_dir="outputs/grpo_wan21_pickscore"),
}

DPO_SDXL: dict[str, dict] = {
    # SalesforceAIResearch/DiffusionDPO launchers/sdxl.sh: beta 5000, fp16-fix VAE, effective lr 2.048e-5
    "sdxl-pickapic": dict(
        model_name_or_path="stabilityai/stable-diffusion-xl-base-1.0", vae_name_or_path="madebyollin/sdxl-vae-fp16-fix",
        dataset_name="yuvalkirstain/pickapic_v2", eval_split="validation_unique", beta=5000.0, caption_dropout=0.2,
        resolution=1024, lora_rank=64, learning_rate=2e-5, batch_size=64, micro_batch_size=1, max_steps=2000,
        warmup_steps=200, lr_scheduler_type="constant", optim="adafactor", weight_decay=1e-2, gradient_checkpointing=True,
        torch_dtype="float16",
        num_threads=None, output_dir="outputs/dpo_sdxl_pickapic"),
}

DDPO_AESTHETIC: dict[str, dict] = {
    # ddpo-pytorch config/dgx.py:aesthetic -- 50 DDIM steps, eta 1, CFG 5, LoRA, lr 3e-4, clip 1e-4, adv clip 5
    "sd15-aesthetic": dict(
        model_name_or_path="runwayml/stable-diffusion-v1-5", prompt_set="animals", reward_funcs="aesthetic",
        reward_weights=None, num_steps=50, guidance_scale=5.0, eta=1.0, resolution=512, lora_rank=4,
        learning_rate=3e-4, prompts_per_step=32, num_generations=8, micro_batch_size=4, train_chunk_size=4, max_steps=200,
        num_eval=64,
        torch_dtype="float16", timestep_fraction=1.0, min_step_std=0.0, num_mini_batches=1, epsilon=1e-4, beta=0.0,
        lr_scheduler_type="constant",
        eval_steps=50, num_threads=0,
        output_dir="outputs/ddpo_sd15_aesthetic"),
}

"""GPU benchmark entry (called by benchmarks/gpu.sh on a lent H200): the suite's comparisons at real sizes
with randomly initialised real architectures. Nothing is downloaded.

    python -m benchmarks.gpu                        # cuda, real sizes, writes $OUT/gpu_results.{json,md}
    python -m benchmarks.gpu --device cpu --tiny    # dry run of every code path on CPU (tiny sizes)

(from the repository root). A real-size run's JSON goes into ``benchmarks/results/`` with
``python -m benchmarks.record $OUT/gpu_results.json --kind gpu_h200``.

Architectures (random init from configs with the published dims):
  LM     Qwen2.5-0.5B: Qwen2Config(hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV heads,
         vocab 151936, rope_theta 1e6, tied embeddings), bf16, sdpa attention. The prompts use the embedded
         character tokenizer (its ids are a subset of the vocab; unknown sampled ids decode to nothing).
  SD1.5  UNet2DConditionModel(block_out_channels (320, 640, 1280, 1280), 2 layers/block, cross-attn 768,
         head dim 8), 64x64 latents (512 px), fp16.
  SDXL   UNet2DConditionModel(block_out_channels (320, 640, 1280), transformer layers (1, 2, 10), head dims
         (5, 10, 20), cross-attn 2048, text_time embedding 256 / 2816), 128x128 latents (1024 px), fp16.
  SD3.5-M SD3Transformer2DModel(24 layers, 24 heads x 64, dual attention in layers 0-12, RMS qk-norm, joint dim
         4096, caption projection 1536, pooled 2048, patch 2, 16 latent channels), 64x64 latents, bf16.
  Text encoders / VAE: small random ones (they are not what is measured), except where noted.

Rows (each in try/except; a failure is recorded in its row and the rest continue; a time guard skips
what would overrun the budget):
  G-P1     token log-prob + entropy fwd+bwd, B x T = 4 x 1024, V 151936, H 896: ours vs TRL (benchmarks/logprob.py)
  G-LM     ours CausalLMPolicy.log_prob fwd+bwd on the Qwen2.5-0.5B-sized model: tokens/s, peak memory, MFU
  G-P2     GRPO end to end ours vs TRL GRPOTrainer (P2's harness) on the Qwen-sized model: completion tokens/s;
           ours again with generation_cache="static" (G-P2-static: decoding compiled, CUDA graphs)
  G-P2-vllm the same with vLLM colocated on both sides (needs vllm installed; an error row says so otherwise);
           G-P2-vllm-async: ours on vLLM with async rollouts (max_staleness 1) against ours on vLLM synchronously
  G-P3     DPO step ours vs TRL DPOTrainer on the Qwen-sized model: step time, first-step loss
  G-P4-*   SD1.5 / SDXL sampling, DiffusionPolicy.sample vs the stock pipeline: samples/s, MFU of the UNet
  G-P5     Diffusion-DPO peak memory at SD1.5 size: adapter-disabled reference vs frozen copy (subprocesses)
  G-P11-*  image RL on an SD3.5-medium-sized SD3Transformer2DModel (random weights, bf16, LoRA r32, 64x64 latents):
           seconds per optimizer step and images/s of collection for flow_grpo, grpo_guard and flow_dppo (10 SDE
           steps, CFG 4.5), awm (14 Euler steps, no CFG, 6 pairs), nft (10 Euler steps from the old policy, 9 pairs)
           and dgpo (10 Euler steps, no CFG, 4 pairs shared by the group, whole-group micro-batches), one group of 24
  G-P13-*  a masked-diffusion LM at LLaDA-8B's dims (a native ModernBertForMaskedLM, random weights, bf16): block
           decoding tokens/s (8 x 256 tokens, blocks of 32, 64 steps) and each estimator's forward + backward time
           and peak memory (gradient checkpointing; ar_order's 256 copies per sequence left out)
  G-P14a   Wan 2.1 text-to-video sampling at Wan2.1-T2V-1.3B's transformer dims (random weights, bf16; 33 frames of
           480 x 832): FlowPolicyBase(family=WanFamily).sample (SDE steps, per-step log-probs) vs stock WanPipeline

Memory: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. MFU = FLOPs / time / peak,
FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode`` on one extra (untimed) iteration of the
same work (matmuls, convolutions and SDPA attention; a fwd+bwd counts both), peak = 989.4e12 FLOP/s (H200
dense bf16/fp16 tensor core; ``--peak-tflops`` to change). For P1 the analytic 6*N*H*V is also given.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/gpu.py`: the package's imports need the repository root
    raise SystemExit("run as a package, from the repository root: python -m benchmarks.gpu " + " ".join(sys.argv[1:]))

import torch  # noqa: E402

from benchmarks.common import machine_info, markdown_table, median, row  # noqa: E402

T0 = time.perf_counter()
ARGS = None


def elapsed() -> float:
    return time.perf_counter() - T0


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak():
    gc.collect()
    if ARGS.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mem():
    return torch.cuda.max_memory_allocated() if ARGS.device.startswith("cuda") else None


def count_flops(fn) -> float:
    """FLOPs of one call by torch's FlopCounterMode; 0 (MFU reported as n/a) where the counter cannot
    handle an op (torch 2.11's SDPA counter rejects grouped-query attention shapes)."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as fc:
            fn()
    except AssertionError as err:
        print(f"[gpu] flop count unavailable: {err}", flush=True)
        return 0.0
    return float(fc.get_total_flops())


def gib(x) -> str:
    return "n/a" if x is None else f"{x / 2**30:.2f} GiB"


def mfu(flops, seconds):
    return flops / seconds / (ARGS.peak_tflops * 1e12) if flops and seconds else None


def guarded(id_, measure, budget_s):
    """Decorator: run the measurement unless the time guard says it would overrun; errors go in the row."""
    def deco(fn):
        def wrapper(rows):
            if elapsed() + budget_s > ARGS.time_budget:
                rows.append(row(id_, measure, None, None, None, "lower", notes=f"SKIPPED by the time guard "
                                f"({elapsed():.0f}s used, needs ~{budget_s}s, budget {ARGS.time_budget}s)"))
                return
            t0 = time.perf_counter()
            try:
                out = fn()
                for r in out:
                    r["seconds"] = round(time.perf_counter() - t0, 1)
                rows.extend(out)
            except Exception as e:  # noqa: BLE001
                rows.append({**row(id_, measure, None, None, None, "lower", notes=f"ERROR {type(e).__name__}: {e}"),
                             "traceback": traceback.format_exc()[-2000:]})
            finally:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            print(f"[gpu] {id_} done at {elapsed():.0f}s", file=sys.stderr, flush=True)
        return wrapper
    return deco


# ----------------------------------------------------------------------------- LM
def qwen_model(dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from unialign.embedded.arith import build_tokenizer

    tok = build_tokenizer()
    if ARGS.tiny:
        cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                          tie_word_embeddings=True)
    else:  # Qwen/Qwen2.5-0.5B config.json
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, None
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(ARGS.device):
        model = Qwen2ForCausalLM(cfg)
    model.to(dtype)
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model, tok


def lm_dtype():
    return torch.float32 if ARGS.device == "cpu" else torch.bfloat16


def rows_p1(rows):
    @guarded("G-P1", "log-prob+entropy fwd+bwd (4x1024, V 151936)", 60)
    def go():
        from benchmarks import logprob

        T = 32 if ARGS.tiny else 1024
        V = 4096 if ARGS.tiny else 151936
        out = []
        for dt in ("float32", "bfloat16"):
            raw = {r["id"]: r for r in logprob.run(3, device=ARGS.device, tokens=T, vocab=V, dtype=dt,
                                                   methods=("ours", "trl", "floor"))}
            t, m = raw["P1-time"], raw["P1-mem"]
            flops = 6 * 4 * T * 896 * V
            out.append(row(f"G-P1-time-{dt}", f"log-prob+entropy fwd+bwd time ({dt})", t["ours_s"], t["baseline_trl_s"],
                           "s", "lower", 1.0, f"B x T = 4 x {T}, V {V}, H 896; floor {t['floor_s']:.4f}s "
                           f"(ours/floor {t['floor_ratio']:.2f}, target 1.4); MFU ours (6NHV) "
                           f"{(mfu(flops, t['ours_s']) or 0):.3f}", floor_s=t["floor_s"], mfu_ours=mfu(flops, t["ours_s"])))
            out.append(row(f"G-P1-mem-{dt}", f"log-prob+entropy activation memory ({dt})", m["ours_bytes_upper"],
                           m["baseline_trl_bytes"], "bytes", "lower", 1 / 8, m["mem_method"]))
        return out
    go(rows)


def rows_lm(rows):
    @guarded("G-LM", "ours log_prob fwd+bwd on Qwen2.5-0.5B-sized model", 60)
    def go():
        from unialign.text.policy import CausalLMPolicy

        model, tok = qwen_model(lm_dtype())
        pol = CausalLMPolicy(model, tok)
        B, P, C = (2, 16, 16) if ARGS.tiny else (8, 512, 512)
        g = torch.Generator().manual_seed(0)
        V = model.config.vocab_size
        payload = {"prompt_ids": torch.randint(0, V, (B, P), generator=g).to(ARGS.device),
                   "prompt_mask": torch.ones(B, P, dtype=torch.long, device=ARGS.device),
                   "completion_ids": torch.randint(0, V, (B, C), generator=g).to(ARGS.device),
                   "completion_mask": torch.ones(B, C, dtype=torch.long, device=ARGS.device)}
        from unialign.types import Trajectory

        traj = Trajectory(prompts=[""] * B, completions=[""] * B, mask_B_T=torch.ones(B, C, device=ARGS.device),
                          old_logp_B_T=torch.zeros(B, C),
                          truncated_B=torch.zeros(B, dtype=torch.bool), payload=payload)

        def it():
            lp, ent = pol.log_prob_and_entropy(traj)
            (lp.mean() + 0.01 * ent.mean()).backward()
            model.zero_grad(set_to_none=True)

        it()
        reset_peak()
        times = []
        for _ in range(3 if ARGS.tiny else 5):
            sync()
            t0 = time.perf_counter()
            it()
            sync()
            times.append(time.perf_counter() - t0)
        peak = peak_mem()
        tokens = B * (P + C)
        # FlopCounterMode, else the 6 x params x tokens estimate (fwd + bwd, attention not counted)
        flops = count_flops(it) or 6.0 * sum(p.numel() for p in model.parameters()) * tokens
        t = median(times)
        return [row("G-LM-tput", "ours log_prob+entropy fwd+bwd tokens/s (prompt+completion)", tokens / t, None,
                    "tok/s", "higher", None, f"Qwen2.5-0.5B dims, {lm_dtype()}, B={B}, prompt {P} + completion {C}; "
                    f"peak mem {gib(peak)}; MFU {(mfu(flops, t) or 0):.3f} (FlopCounterMode "
                    f"{flops / 1e12:.2f} TFLOP/iter; 6ND when the counter fails)", peak_bytes=peak, flops=flops, mfu=mfu(flops, t), step_s=t)]
    go(rows)


def rows_p2(rows):
    @guarded("G-P2", "GRPO end to end ours vs TRL (Qwen-sized)", 200)
    def go():
        from benchmarks import p2_grpo

        model, tok = qwen_model(lm_dtype())
        P, G, L, steps = (2, 4, 8, 2) if ARGS.tiny else (8, 8, 256, 6)
        tr_rows = p2_grpo.train_rows()
        o_t, o_n, t_t, t_n, s_t, s_n = [], [], [], [], [], []
        with tempfile.TemporaryDirectory() as d:
            ours = p2_grpo.make_ours(copy.deepcopy(model), copy.deepcopy(tok), tr_rows, P, G, L, steps, d + "/o",
                                     generation_cache="dynamic")
            # the same run with a static KV cache (transformers compiles decoding: CUDA graphs), which is what
            # generation_cache="auto" (the default) picks on CUDA; its first step includes the compilation and
            # is dropped like every first step
            static = p2_grpo.make_ours(copy.deepcopy(model), copy.deepcopy(tok), tr_rows, P, G, L, steps, d + "/s",
                                       generation_cache="static")
            trl_model = model  # the original: TRL trains it in place
            trainer, reward = p2_grpo.make_trl(trl_model, copy.deepcopy(tok), tr_rows, P, G, L, steps, d + "/t")
            trainer.add_callback(p2_grpo._interleave_callback(t_t, t_n, o_t, o_n, reward, ours,
                                                              others=[(static, s_t, s_n)]))
            reset_peak()
            trainer.train()
        tps = lambda ts, ns: [n / t for t, n in zip(ts[1:], ns[1:])]  # noqa: E731
        common = (f"Qwen2.5-0.5B dims {lm_dtype()}, P={P} x G={G}, {L} new tokens, beta 0, dapo; TRL transformers "
                  f"generate with its defaults (no vLLM, dynamic cache); {steps} interleaved steps, median after the "
                  f"first; peak mem (three models resident) {gib(peak_mem())}")
        return [row("G-P2-tput", "GRPO completion tokens/s (sample+score+update), ours with generation_cache='dynamic'", median(tps(o_t, o_n)),
                    median(tps(t_t, t_n)), "tok/s", "higher", 3.0, common,
                    raw={"ours_times": o_t, "ours_tokens": o_n, "trl_times": t_t, "trl_tokens": t_n}),
                row("G-P2-static-tput", "GRPO completion tokens/s, ours with generation_cache='static' (the default on CUDA)",
                    median(tps(s_t, s_n)), median(tps(t_t, t_n)), "tok/s", "higher", 3.0,
                    common + "; ours: static KV cache, decoding compiled by transformers (first step incl. compile: "
                    f"{s_t[0] if s_t else float('nan'):.1f} s)",
                    raw={"ours_times": s_t, "ours_tokens": s_n})]
    go(rows)


def rows_p2_vllm(rows):
    @guarded("G-P2-vllm", "GRPO end to end with vLLM on both sides (Qwen-sized)", 240)
    def go():
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("vllm is not installed here: `pip install vllm` on the GPU machine (it pins its own "
                               "torch; its wheel is too large to carry to a lent machine)")
        from benchmarks import p2_grpo

        model, tok = qwen_model(lm_dtype())
        P, G, L, steps = (2, 4, 8, 2) if ARGS.tiny else (8, 8, 256, 6)
        tr_rows = p2_grpo.train_rows()
        o_t, o_n, t_t, t_n = [], [], [], []
        with tempfile.TemporaryDirectory() as d:
            # colocated engines, each with 0.3 of the GPU; both correct for the engine/trainer mismatch (TIS)
            ours = p2_grpo.make_ours(copy.deepcopy(model), copy.deepcopy(tok), tr_rows, P, G, L, steps, d + "/o",
                                     generation_backend="vllm", vllm_options={"gpu_memory_utilization": 0.3})
            trainer, reward = p2_grpo.make_trl(model, copy.deepcopy(tok), tr_rows, P, G, L, steps, d + "/t",
                                               use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
            trainer.add_callback(p2_grpo._interleave_callback(t_t, t_n, o_t, o_n, reward, ours))
            trainer.train()
        tps = lambda ts, ns: [n / t for t, n in zip(ts[1:], ns[1:])]  # noqa: E731
        return [row("G-P2-vllm-tput", "GRPO completion tokens/s, vLLM colocated on both sides", median(tps(o_t, o_n)),
                    median(tps(t_t, t_n)), "tok/s", "higher", 1.3,
                    f"Qwen2.5-0.5B dims {lm_dtype()}, P={P} x G={G}, {L} new tokens, beta 0, dapo; ours "
                    f"--generation_backend vllm, TRL use_vllm=True vllm_mode='colocate'; gpu_memory_utilization 0.3 "
                    f"each; {steps} interleaved steps, median after the first",
                    raw={"ours_times": o_t, "ours_tokens": o_n, "trl_times": t_t, "trl_tokens": t_n})]
    go(rows)

    @guarded("G-P2-vllm-async", "GRPO with vLLM: async rollouts (max_staleness 1) vs the synchronous loop", 200)
    def go_async():
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("vllm is not installed here: `pip install vllm` on the GPU machine")
        from benchmarks import p2_grpo

        model, tok = qwen_model(lm_dtype())
        P, G, L, steps = (2, 4, 8, 3) if ARGS.tiny else (8, 8, 256, 6)
        tr_rows, times = p2_grpo.train_rows(), {}
        # one after the other (the async side's thread would overlap an interleaved partner): the same model, data
        # and seed; the engine samples batch b + 1 from the lagging copy while update b runs
        for side, is_async in (("sync", False), ("async", True)):
            with tempfile.TemporaryDirectory() as d:
                trainer = p2_grpo.make_ours(copy.deepcopy(model), copy.deepcopy(tok), tr_rows, P, G, L, steps, d,
                                            async_rollouts=is_async, max_staleness=1, generation_backend="vllm",
                                            vllm_options={"gpu_memory_utilization": 0.3})
                ts, ns = [], []
                try:
                    for _ in range(steps):
                        t, n = p2_grpo.ours_step(trainer)
                        ts.append(t)
                        ns.append(n)
                finally:
                    if trainer.rollouts is not None:
                        trainer.rollouts.close()
                    engine = getattr(trainer.policy.rollout, "engine", None)
                    del trainer, engine  # each side its own engine: free the first before the second is built
                    gc.collect()
                    torch.cuda.empty_cache()
                times[side] = ts, ns
        tps = lambda ts, ns: [n / t for t, n in zip(ts[1:], ns[1:])]  # noqa: E731
        return [row("G-P2-vllm-async-tput", "GRPO completion tokens/s with vLLM, async rollouts vs synchronous",
                    median(tps(*times["async"])), median(tps(*times["sync"])), "tok/s", "higher", 1.2,
                    f"Qwen2.5-0.5B dims {lm_dtype()}, P={P} x G={G}, {L} new tokens, beta 0, dapo; "
                    f"--generation_backend vllm, gpu_memory_utilization 0.3, async max_staleness 1 (the engine "
                    f"awake through the update) vs synchronous (sleep level 2 through it); {steps} steps each, one "
                    "side after the other, median after the first",
                    raw={"async_times": times["async"][0], "async_tokens": times["async"][1],
                         "sync_times": times["sync"][0], "sync_tokens": times["sync"][1]})]
    go_async(rows)


def rows_p3(rows):
    @guarded("G-P3", "DPO step ours vs TRL (Qwen-sized)", 90)
    def go():
        from transformers import TrainerCallback

        from benchmarks import p3_dpo

        model, tok = qwen_model(lm_dtype())
        B, steps = (2, 3) if ARGS.tiny else (8, 6)
        pr = p3_dpo.pairs(256)
        o_t, t_t, o_l, t_l = [], [], [], []
        with tempfile.TemporaryDirectory() as d:
            ours = p3_dpo.make_ours(copy.deepcopy(model), copy.deepcopy(tok), pr, B, steps, d + "/o")

            def ours_step():
                sync()
                t0 = time.perf_counter()
                m = ours.train_step()
                sync()
                o_t.append(time.perf_counter() - t0)
                o_l.append(m["loss"])

            class CB(TrainerCallback):
                def on_step_begin(self, args, state, control, **kw):
                    if state.global_step % 2 == 1:
                        ours_step()
                    sync()
                    self.t0 = time.perf_counter()

                def on_step_end(self, args, state, control, **kw):
                    sync()
                    t_t.append(time.perf_counter() - self.t0)
                    if (state.global_step - 1) % 2 == 0:
                        ours_step()

                def on_log(self, args, state, control, logs=None, **kw):
                    if logs and "loss" in logs:
                        t_l.append(float(logs["loss"]))

            tr = p3_dpo.make_trl(model, copy.deepcopy(tok), pr, B, steps, d + "/t")
            tr.add_callback(CB())
            tr.train()
        l0o, l0t = (o_l or [None])[0], (t_l or [None])[0]
        return [row("G-P3-time", "DPO optimizer-step time", median(o_t[1:]), median(t_t[1:]), "s", "lower", None,
                    f"Qwen2.5-0.5B dims {lm_dtype()}, B={B} pairs, full-copy reference, no precompute, no grad "
                    f"checkpointing; {steps} interleaved steps", raw={"ours": o_t, "trl": t_t}),
                row("G-P3-loss0", "first-step DPO loss (ln 2)", l0o, l0t, "nats", "lower", None,
                    f"|ours - TRL| = {abs(l0o - l0t) if l0o is not None and l0t is not None else 'n/a'}")]
    go(rows)


# ----------------------------------------------------------------------------- diffusion
SD15 = dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, cross_attention_dim=768,
            attention_head_dim=8, sample_size=64,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
SDXL = dict(block_out_channels=(320, 640, 1280), layers_per_block=2, cross_attention_dim=2048,
            attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
            sample_size=128, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"))


def tiny_cfg(kind):
    base = dict(block_out_channels=(32, 64), layers_per_block=1, attention_head_dim=8, sample_size=8,
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    if kind == "sd15":
        return {**base, "cross_attention_dim": 32}
    return {**base, "cross_attention_dim": 48, "use_linear_projection": True, "addition_embed_type": "text_time",
            "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 6 * 8 + 16,
            "transformer_layers_per_block": (1, 1), "attention_head_dim": (2, 4)}


def sd_components(kind):
    from diffusers import DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from benchmarks import sd_parts

    cfg = tiny_cfg(kind) if ARGS.tiny else (SD15 if kind == "sd15" else SDXL)
    dtype = torch.float32 if ARGS.device == "cpu" else torch.float16
    torch.manual_seed(0)
    with torch.device(ARGS.device):
        unet = UNet2DConditionModel(in_channels=4, out_channels=4, **cfg)
    unet.to(dtype)
    tok = sd_parts.tokenizer()

    def enc(hidden, proj=None):
        c = CLIPTextConfig(vocab_size=520, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                           num_hidden_layers=2, max_position_embeddings=sd_parts.MAX_LEN, projection_dim=proj or hidden,
                           bos_token_id=sd_parts.BOS, eos_token_id=sd_parts.EOS, pad_token_id=sd_parts.EOS)
        with torch.device(ARGS.device):
            m = (CLIPTextModelWithProjection if proj else CLIPTextModel)(c)
        return m.to(dtype).eval()

    parts = dict(unet=unet, vae=sd_parts.vae().to(ARGS.device), tokenizer=tok,
                 scheduler=DDIMScheduler(**sd_parts.SD15_SCHEDULER))
    if kind == "sd15":
        parts["text_encoder"] = enc(cfg["cross_attention_dim"])
    else:  # SDXL: 768 + 1280 = 2048 (tiny: 32 + 16), pooled projection 1280 (tiny 16)
        h1, h2 = (32, 16) if ARGS.tiny else (768, 1280)
        parts["text_encoder"], parts["text_encoder_2"], parts["tokenizer_2"] = enc(h1), enc(h2, h2), tok
    return parts


def rows_p4(rows, kind, budget):
    @guarded(f"G-P4-{kind}", f"{kind} sampling", budget)
    def go():
        from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

        from benchmarks import p4_diffusion_sampling
        from unialign.image import DiffusionPolicy

        parts = sd_components(kind)
        steps = 4 if ARGS.tiny else 20
        batch = 2 if ARGS.tiny else 4
        # pixels = latents x 2 with the small VAE (scale factor 2): we time the UNet-dominated loop; both decode alike
        policy = DiffusionPolicy(**parts, num_steps=steps, guidance_scale=5.0, eta=1.0)
        cls = StableDiffusionXLPipeline if kind == "sdxl" else StableDiffusionPipeline
        extra = {} if kind == "sdxl" else dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        # the pipeline runs its VAE in the model dtype, as diffusers users do (the policy keeps its fp32 VAE)
        vae = copy.deepcopy(parts["vae"]).to(policy.dtype)
        pipe = cls(**{k: v for k, v in parts.items() if k not in ("scheduler", "vae")}, vae=vae,
                   scheduler=policy.scheduler, **extra)
        pipe.set_progress_bar_config(disable=True)
        prompts = ["a cat on a mat"] * batch
        dev = ARGS.device
        # the two sides of P4 (benchmarks/p4_diffusion_sampling.py) at this size
        ours = functools.partial(p4_diffusion_sampling.sample_ours, policy, prompts, 0, dev)
        base = functools.partial(p4_diffusion_sampling.sample_diffusers, pipe, prompts, steps, 5.0, 1.0, policy.height,
                                 policy.width, 0, dev)

        with torch.no_grad():
            ours()
            base()
            reset_peak()
            ours()
            peak = peak_mem()
            times = {"ours": [], "base": []}
            for i in range(3 if ARGS.tiny else 5):
                for name, fn in ((("ours", ours), ("base", base)) if i % 2 == 0 else (("base", base), ("ours", ours))):
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    times[name].append(time.perf_counter() - t0)
            lat = torch.randn(2 * batch, 4, policy.height // 2, policy.width // 2, device=dev, dtype=policy.dtype)
            cond = policy.encode_prompts(prompts * 2)
            added = None
            if policy.is_sdxl:
                added = {"text_embeds": cond["pooled_prompt_embeds"], "time_ids": policy.time_ids(2 * batch)}
            t_B = torch.full((2 * batch,), 500, device=dev)
            unet_flops = count_flops(lambda: policy.unet(lat, t_B, encoder_hidden_states=cond["prompt_embeds"],
                                                         added_cond_kwargs=added))
        to, tb = median(times["ours"]), median(times["base"])
        flops = unet_flops * steps
        return [row(f"G-P4-{kind}", f"{kind}-sized UNet sampling, samples/s", batch / to, batch / tb, "samples/s",
                    "higher", 1 / 1.03, f"{policy.height // 2}x{policy.width // 2} latents, {steps} DDIM steps, eta 1, "
                    f"CFG 5, batch {batch}, fp16; UNet MFU ours {(mfu(flops, to) or 0):.3f} / pipeline "
                    f"{(mfu(flops, tb) or 0):.3f}; peak mem ours {gib(peak)}; overhead ratio "
                    f"(time) {to / tb:.3f} (target <= 1.03)", ours_s=to, base_s=tb, unet_flops_per_call=unet_flops,
                    peak_bytes=peak, raw=times)]
    go(rows)


def rows_p5(rows):
    @guarded("G-P5", "Diffusion-DPO memory SD1.5-sized", 120)
    def go():
        from benchmarks.common import run_child

        kw = dict(block_out_channels=[32, 64] if ARGS.tiny else [320, 640, 1280, 1280],
                  sample_size=8 if ARGS.tiny else 64, pairs=2, steps=2,
                  cross_attention_dim=32 if ARGS.tiny else 768, device=ARGS.device)
        res = {impl: run_child("p5_diffusion_dpo_memory", "dpo_child", dict(impl=impl, **kw), timeout=300)
               for impl in ("ours", "copy")}
        errs = [v["error"] for v in res.values() if "error" in v]
        if errs:
            raise RuntimeError("; ".join(errs))
        o, c = res["ours"], res["copy"]
        return [row("G-P5", "Diffusion-DPO peak memory (adapter-off ref vs frozen copy)", o["peak_bytes"],
                    c["peak_bytes"], "bytes", "lower", 0.6, f"SD1.5-sized UNet fp32 ({o['unet_bytes'] / 2**30:.2f} GiB), "
                    f"LoRA r8, 64x64 latents, 2 pairs, 2 steps; {o['method']}; loss0 ours {o['losses'][0]:.6f} / copy "
                    f"{c['losses'][0]:.6f}", raw=res)]
    go(rows)


# ----------------------------------------------------------------------------- forward-process image RL
SD35M = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
             num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
             pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
# the papers' batch shapes per method (Flow-GRPO config/grpo.py geneval_sd3; AWM config/dgx_awm.py; DiffusionNFT
# config/nft.py): solver steps, CFG, samples per micro-batch; each timed step is one group of 24 images
# (+ DGPO config/dgpo_wocfg.py geneval: 10 steps CFG-free, the loss on whole groups; GRPO-Guard and Flow-DPPO:
# Flow-GRPO's shapes, verl-omni's examples)
P11_METHODS = {"flow_grpo": dict(num_steps=10, guidance_scale=4.5, micro_batch_size=4, sde_window_size=0),
               "awm": dict(num_steps=14, guidance_scale=1.0, micro_batch_size=3),
               "nft": dict(num_steps=10, guidance_scale=1.0, micro_batch_size=9),
               "dgpo": dict(num_steps=10, guidance_scale=1.0, micro_batch_size=24),
               "grpo_guard": dict(num_steps=10, guidance_scale=4.5, micro_batch_size=4, sde_window_size=0),
               "flow_dppo": dict(num_steps=10, guidance_scale=4.5, micro_batch_size=4, sde_window_size=0)}


def rows_p11(rows):
    @guarded("G-P11", "image RL step on an SD3.5-M-sized transformer", 240)
    def go():
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        from benchmarks import p10_flow, sd_parts
        from benchmarks.p10_flow import _timed_step, clip_with_projection, sd3_vae
        from unialign.image.flow_policy import FlowMatchingPolicy
        from unialign.recipes.image import ImageRLConfig, forward_process_kwargs
        from unialign.trainers import OnlineTrainer

        dev, dtype = ARGS.device, (torch.float32 if ARGS.device == "cpu" else torch.bfloat16)
        size = (dict(sample_size=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                     caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=16,
                     dual_attention_layers=(0,), qk_norm="rms_norm", patch_size=2, in_channels=16, out_channels=16)
                if ARGS.tiny else SD35M)
        group, latent = (4, 8) if ARGS.tiny else (24, 64)
        torch.manual_seed(0)
        with torch.device(dev):
            base = SD3Transformer2DModel(**size)
        base.to(dtype)
        proj = size["pooled_projection_dim"] // 2  # CLIP-L / CLIP-G stand-ins: their pooled projections concatenate
        out = []
        with tempfile.TemporaryDirectory() as tmp:
            for method, shape in P11_METHODS.items():
                cfg = ImageRLConfig(algorithm=method, prompts_per_step=1, num_generations=group, lora_rank=32,
                                    learning_rate=3e-4, num_mini_batches=1, max_steps=10**6, seed=0, report_to="none",
                                    output_dir=f"{tmp}/{method}", num_eval=1, beta=0.0,
                                    **{k: v for k, v in shape.items() if k != "sde_window_size"},
                                    **({"sde_window_size": 0} if "sde_window_size" in shape else {}))
                parts = dict(transformer=copy.deepcopy(base), vae=sd3_vae().to(dev),
                             text_encoder=clip_with_projection(projection=proj).to(dev, dtype),
                             text_encoder_2=clip_with_projection(projection=proj).to(dev, dtype),
                             tokenizer=sd_parts.tokenizer(), tokenizer_2=sd_parts.tokenizer(),
                             scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
                policy = FlowMatchingPolicy(**parts, num_steps=cfg.num_steps, guidance_scale=cfg.guidance_scale,
                                            noise_level=0.7, max_sequence_length=p10_flow.TEXT_TOKENS,
                                            sde_window_size=0, lora_rank=32, height=2 * latent, width=2 * latent,
                                            train_chunk_size=cfg.micro_batch_size, sample_batch_size=8)
                forward = forward_process_kwargs(cfg)
                if forward is not None:
                    policy.use_forward_process(**forward)
                trainer = OnlineTrainer(policy, p10_flow._brightness, [{"prompt": p} for p in sd_parts.PROMPTS], cfg)
                _timed_step(trainer)  # warm-up: allocations, the first update's ratio-1 check
                reset_peak()
                times = [_timed_step(trainer) for _ in range(1 if ARGS.tiny else 2)]
                peak = peak_mem()
                step_s, collect_s = median([t["step_s"] for t in times]), median([t["collect_s"] for t in times])
                out.append(row(f"G-P11-{method}", f"{method}: seconds per optimizer step (one group of {group})",
                               step_s, None, "s", "lower", None,
                               f"SD3.5-M-sized transformer, random weights, {dtype}, LoRA r32, {latent}x{latent} "
                               f"latents; {cfg.num_steps} steps, CFG {cfg.guidance_scale}, micro-batch "
                               f"{cfg.micro_batch_size}; collection {group / collect_s:.2f} images/s, update "
                               f"{step_s - collect_s:.1f} s; peak mem {gib(peak)}",
                               collect_images_per_s=group / collect_s, update_s=step_s - collect_s, peak_bytes=peak,
                               raw=times))
                del trainer, policy, parts
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        return out
    go(rows)


# LLaDA-8B's dims (GSAI-ML/LLaDA-8B-Instruct config.json: d_model 4096, 32 layers, 32 heads, MLP 12288, vocab
# 126464) on transformers' native bidirectional masked LM (LLaDA's own code is remote): the same matmul shapes
LLADA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=12288,
                vocab_size=126464)


def rows_p13(rows):
    @guarded("G-P13", "masked-diffusion LM at LLaDA-8B size: sampling and the estimators", 200)
    def go():
        from transformers import ModernBertConfig, ModernBertForMaskedLM

        from benchmarks.p13_dlm import PROMPTS
        from unialign.algos.masked_diffusion import LOG_PROB_ESTIMATORS, forwards_per_sequence
        from unialign.dlm import FAMILIES, DiffusionSampling, MaskedDiffusionLMPolicy
        from unialign.embedded.mdlm import build_tokenizer

        dev, dtype = ARGS.device, (torch.float32 if ARGS.device == "cpu" else torch.bfloat16)
        tok = build_tokenizer()
        dims = (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     vocab_size=len(tok)) if ARGS.tiny else LLADA_8B)
        cfg = ModernBertConfig(**dims, global_attn_every_n_layers=1, local_attention=4096, max_position_embeddings=4096,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=1,
                               cls_token_id=1, sep_token_id=tok.eos_token_id, attn_implementation="sdpa")
        torch.manual_seed(0)
        with torch.device(dev):
            model = ModernBertForMaskedLM(cfg).to(dtype)
        gen, block, steps, batch = (16, 8, 4, 2) if ARGS.tiny else (256, 32, 64, 8)
        sampling = DiffusionSampling(gen_length=gen, block_length=block, steps=steps)
        policy = MaskedDiffusionLMPolicy(model, tok, FAMILIES["modernbert"], sampling=sampling)
        prompts = (PROMPTS * batch)[:batch]
        policy.generate(prompts[:1], greedy=True)  # warm-up
        sync()
        t = time.perf_counter()
        traj = policy.sample(prompts, record_logp=False)
        sync()
        sample_s = time.perf_counter() - t
        out = [row("G-P13-sample", f"LLaDA-8B-sized masked LM: block decoding, {batch} x {gen} tokens, blocks of {block}, "
                   f"{steps} steps", batch * gen / sample_s, None, "tokens/s", "higher", None,
                   f"random weights, {dtype}; {policy.last_forwards} forwards")]
        if not ARGS.tiny:
            model.gradient_checkpointing_enable()
        for name in LOG_PROB_ESTIMATORS:
            if name in ("ar_order",) and not ARGS.tiny:  # T = 256 masked copies per sequence: minutes, skip
                continue
            policy.estimator = name
            policy.max_rows_per_forward = 2 if not ARGS.tiny else 1024
            reset_peak()
            sync()
            t = time.perf_counter()
            policy.log_prob(traj).sum().backward()
            sync()
            fw = forwards_per_sequence(name, policy.estimator_options, gen, steps)
            out.append(row(f"G-P13-{name}", f"estimator {name}: forward + backward of log_prob, {batch} sequences",
                           time.perf_counter() - t, None, "s", "lower", None, f"{fw} forwards per sequence; peak "
                           f"{gib(peak_mem())}", forwards=fw, peak_bytes=peak_mem()))
            model.zero_grad(set_to_none=True)
        return out
    go(rows)


def rows_p14(rows):
    @guarded("G-P14a", "Wan 2.1 sampling with per-step log-probs vs stock WanPipeline", 150)
    def go():
        from benchmarks import p14_video

        dev = ARGS.device
        dtype = torch.float32 if dev == "cpu" else torch.bfloat16
        if ARGS.tiny:
            size, steps, batch, repeats = dict(p14_video.SIZE), 4, 1, 2
        else:  # Wan2.1-T2V-1.3B's transformer, 33 frames of 480 x 832 (9 x 60 x 104 latents: 14,040 video tokens)
            size, steps, batch, repeats = dict(p14_video.WAN_1_3B, height=480, width=832, frames=33), 10, 1, 3
        r = p14_video.measure_sampling(batch=batch, steps=steps, guidance=5.0, noise_level=0.7, repeats=repeats,
                                       sync=sync, device=dev, dtype=dtype, **size)
        dims = "tiny" if ARGS.tiny else "1.3B transformer dims"
        return [row("G-P14a", f"Wan 2.1 sampling ({dims}, {size.get('frames')} frames "
                    f"{size.get('height')}x{size.get('width')}, {steps} steps, CFG 5, batch {batch}): ours (SDE steps, "
                    "per-step log-probs) vs stock WanPipeline", r["ours_s"], r["stock_s"], "s", "lower", 1.03,
                    f"random weights, {dtype}, {r['transformer_params'] / 1e9:.2f}B transformer params; median of "
                    f"{repeats} interleaved calls; pair median {r['pair_ratio_median']:.3f}; stock calls the "
                    "transformer twice a step, ours once on a doubled batch")]
    go(rows)


def main(argv=None):
    global ARGS
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU dry run of the code paths)")
    p.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16/fp16 peak of the accelerator")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds; later rows are skipped past it")
    p.add_argument("--only", default="", help="comma-separated: P1,LM,P2,P2V (vLLM on both sides),P3,P4,P5,P11,P13,"
                   "P14")
    p.add_argument("--output-dir", default=os.environ.get("OUT") or ".")
    ARGS = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ARGS.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out_dir = Path(ARGS.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": "python -m benchmarks.gpu" + "".join(" " + shlex.quote(x) for x in (sys.argv[1:] if argv is None
                                                                                       else argv)),
              "args": vars(ARGS), "rows": []}
    want = set(ARGS.only.split(",")) if ARGS.only else {"P1", "LM", "P2", "P2V", "P3", "P4", "P5", "P11", "P13",
                                                        "P14"}
    steps = [("P1", rows_p1), ("LM", rows_lm), ("P4", lambda r: rows_p4(r, "sd15", 60)),
             ("P4", lambda r: rows_p4(r, "sdxl", 90)), ("P5", rows_p5), ("P3", rows_p3), ("P2", rows_p2),
             ("P2V", rows_p2_vllm), ("P11", rows_p11), ("P13", rows_p13), ("P14", rows_p14)]
    for key, fn in steps:
        if key in want:
            fn(result["rows"])
            result["seconds"] = round(elapsed(), 1)
            (out_dir / "gpu_results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
            (out_dir / "gpu_results.md").write_text(
                f"Device: {result['machine'].get('cuda') or 'cpu'}; torch {result['machine']['torch']}; "
                f"{'TINY dry run' if ARGS.tiny else 'real sizes'}\n\n" + markdown_table(result["rows"]))
    print(markdown_table(result["rows"]))


if __name__ == "__main__":
    main()

"""Step-chunked DDPO update: a micro-batch's trained (sample, step) pairs split into chunks
with one backward each, under the optimizer step's one loss normaliser, give the gradients of the
unchunked update, while each UNet call holds at most one chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unialign.trainers import OnlineConfig, OnlineTrainer


def brightness(prompts, completions):
    return [float(np.asarray(img, dtype=np.float32).mean() / 255.0) for img in completions]


def test_step_chunks_partition_the_mask(make_policy):
    policy = make_policy("sd", timestep_fraction=0.5, train_chunk_size=3)
    mask = torch.tensor([[1.0, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 0]])
    chunks = policy.step_chunks(mask)
    assert len(chunks) == 3  # 7 pairs in chunks of <= 3
    assert torch.equal(torch.stack(chunks).sum(0), mask)
    assert all(int(c.sum()) <= 3 for c in chunks) and all(((c == 0) | (mask == 1)).all() for c in chunks)
    policy.train_chunk_size = 0
    assert len(policy.step_chunks(mask)) == 1
    with pytest.raises(ValueError, match="train_chunk_size"):
        make_policy("sd", train_chunk_size=-1)


def _grads(policy, trainer, traj, chunk: int) -> tuple[dict[str, torch.Tensor], float, list[int]]:
    """Gradients of one ``trainer.update(traj)`` (the optimizer step is replaced by a capture) with
    ``train_chunk_size=chunk``, its loss, and the batch size of every UNet call."""
    policy.train_chunk_size = chunk
    grads, rows = {}, []

    def capture():
        grads.update({n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None})

    trainer.optimizer.step = capture
    unet_forward = policy.unet.forward

    def spy(sample, *a, **k):
        rows.append(sample.shape[0])
        return unet_forward(sample, *a, **k)

    policy.unet.forward = spy
    try:
        torch.manual_seed(0)
        out = trainer.update(traj)
    finally:
        del policy.unet.forward
    return grads, out["loss"], rows


@pytest.mark.parametrize("algorithm,beta", [("ddpo", 0.0), ("grpo", 0.05)])
def test_chunked_update_gives_the_unchunked_gradients(make_policy, tmp_path, algorithm, beta):
    # CFG on (two branches per row); grpo aggregates per-sequence means (the chunk is counted against the
    # whole mask) and beta > 0 adds the closed-form KL to the reference the policy computes per chunk
    policy = make_policy("sd", num_steps=4, guidance_scale=3.0, timestep_fraction=0.75)
    cfg = OnlineConfig(algorithm=algorithm, num_generations=2, prompts_per_step=2, micro_batch_size=4,
                       max_steps=1, learning_rate=1e-3, beta=beta, kl_estimator="gaussian" if beta else None,
                       report_to="none", output_dir=str(tmp_path))
    trainer = OnlineTrainer(policy, brightness, [{"prompt": "a red circle"}, {"prompt": "a blue square"}], cfg)
    traj, _ = trainer.collect()
    traj.advantages_B_T = torch.linspace(-1, 1, traj.mask_B_T.numel()).view_as(traj.mask_B_T)  # all non-zero
    pairs = int(traj.mask_B_T.sum())  # 4 samples x 3 trained steps
    whole, loss_whole, rows_whole = _grads(policy, trainer, traj, 0)
    chunked, loss_chunked, rows_chunked = _grads(policy, trainer, traj, 5)
    assert rows_whole == [2 * pairs]  # one policy UNet call (the reference is a frozen copy, not spied)
    assert max(rows_chunked) <= 2 * 5 and len(rows_chunked) == -(-pairs // 5)
    assert whole.keys() == chunked.keys() and len(whole) > 0
    for name in whole:  # equal up to float32 summation order (batch 24 vs 10 in each conv / matmul)
        scale = float(whole[name].abs().max())
        torch.testing.assert_close(chunked[name], whole[name], rtol=1e-4, atol=1e-4 * scale + 1e-12)
    assert loss_chunked == pytest.approx(loss_whole, rel=1e-5, abs=1e-9)
    assert any(float(g.abs().max()) > 0 for g in whole.values())


def test_sequence_level_ratios_are_not_chunked(make_policy, tmp_path):
    policy = make_policy("sd", num_steps=4, timestep_fraction=1.0, train_chunk_size=1)
    cfg = OnlineConfig(algorithm="gspo", num_generations=2, prompts_per_step=1, micro_batch_size=2, max_steps=1,
                       beta=0.0, report_to="none", output_dir=str(tmp_path))
    trainer = OnlineTrainer(policy, brightness, [{"prompt": "a red circle"}], cfg)
    traj, _ = trainer.collect()
    assert trainer._step_chunks(traj) == [None]  # GSPO's ratio is a mean over the sample's steps


def test_sampling_in_chunks(make_policy):
    """``sample_batch_size`` denoises a batch a few images at a time: same shapes, the first chunk is the
    unchunked sample of its prompts under the same seed, and the recorded log-probs are the policy's."""
    prompts = ["a red circle", "a blue square", "a green circle", "a red square", "a blue circle"]
    policy = make_policy("sd", num_steps=3, timestep_fraction=1.0, sample_batch_size=2)
    with torch.no_grad():
        traj = policy.sample(prompts, generator=torch.Generator().manual_seed(0))
        policy.sample_batch_size = 0
        first = policy.sample(prompts[:2], generator=torch.Generator().manual_seed(0))
        whole = policy.sample(prompts, generator=torch.Generator().manual_seed(0))
        logp = policy.log_prob(traj)
    assert len(traj.completions) == 5 and traj.payload["latents"].shape == whole.payload["latents"].shape
    assert torch.equal(traj.payload["latents"][:2], first.payload["latents"])
    assert not torch.equal(traj.payload["latents"], whole.payload["latents"])  # later chunks draw after the first
    torch.testing.assert_close(logp, traj.old_logp_B_T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="sample_batch_size"):
        make_policy("sd", sample_batch_size=-1)

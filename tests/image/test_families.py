"""SD1.x and SDXL as two family adapters of ``DiffusionPolicy``: the values a tiny SD / SDXL policy gives for a
fixed seed -- sampled trajectories, their log-probs, the recomputed log-probs, a preference batch and its
Diffusion-DPO surrogate -- are literal numbers recorded from the policy before it was split into families
(one ``if is_sdxl`` branch per family-specific part), so the split changes no behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from unialign.types import PreferenceBatch

CASES = [  # (name, make_policy kind, extra policy kwargs)
    ("sd", "sd", {}),
    ("sdxl", "sdxl", {}),
    ("sdxl_zeros", "sdxl", {"force_zeros_for_empty_prompt": True}),
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _images() -> list[dict]:
    """Two preference pairs of seeded noise images of different sizes (so SDXL's per-side time_ids differ)."""
    rng = np.random.default_rng(7)

    def im(h: int, w: int) -> Image.Image:
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    return [{"prompt": "a cat", "chosen": im(20, 24), "rejected": im(16, 16)},
            {"prompt": "cat", "chosen": im(18, 16), "rejected": im(24, 20)}]


def measure(policy) -> dict[str, list]:
    """Fixed-seed outputs of ``policy`` as nested float lists."""
    traj = policy.sample(["a cat", "cat"], generator=torch.Generator().manual_seed(1234))
    x0 = traj.payload["latents"][:, -1].double()  # [B, C, H, W]
    out = {
        "payload_keys": sorted(traj.payload),
        "old_logp_B_T": traj.old_logp_B_T.double().tolist(),
        "x0_corner": x0[:, 0, 0, :4].tolist(),
        "x0_mean_sq": x0.pow(2).mean(dim=(1, 2, 3)).tolist(),
        "x0_mean": x0.mean(dim=(1, 2, 3)).tolist(),
        "log_prob": policy.log_prob(traj).detach().double().tolist(),
    }
    w_sample = policy.guidance_scale
    for w in (1.5, 1.0):  # another CFG weight and no CFG: the recorded steps under a different step mean
        policy.guidance_scale = w
        out[f"log_prob_w{w}"] = policy.log_prob(traj).detach().double().tolist()
    policy.guidance_scale = w_sample
    batch = policy.preference_batch(_images())
    out["pref_keys"] = [sorted(batch.chosen), sorted(batch.payload)]
    out["pref_time_ids"] = [side["time_ids"].tolist() for side in (batch.chosen, batch.rejected)
                            if "time_ids" in side]
    with torch.no_grad():
        out["seq_logp"] = [v.double().tolist() for v in policy.sequence_log_prob(batch)]
        # no per-side time_ids and no embeddings in the payload: SDXL's default time_ids, prompts encoded again
        bare = PreferenceBatch(prompts=batch.prompts, chosen={"latents": batch.chosen["latents"]},
                               rejected={"latents": batch.rejected["latents"]},
                               payload={k: batch.payload[k] for k in ("timesteps", "noise")})
        out["seq_logp_bare"] = [v.double().tolist() for v in policy.sequence_log_prob(bare)]
    return out


EXPECTED: dict[str, dict[str, list]] = {'sd': {'payload_keys': ['latents', 'prompt_embeds', 'timesteps'],
        'old_logp_B_T': [[-1.1170741319656372, -0.8076181411743164, 1.713869333267212, 2.409886121749878],
                         [-1.194515347480774, -0.890570878982544, 1.7289369106292725, 2.4251368045806885]],
        'x0_corner': [[0.927966833114624, -1.2375227212905884, 1.5366860628128052, -5.011086463928223],
                      [-6.04215669631958, 2.8662919998168945, -0.6543564796447754, 0.5903089046478271]],
        'x0_mean_sq': [22.443566182520968, 28.02042926950611],
        'x0_mean': [-0.3780780965971644, -0.13816445469274186],
        'log_prob': [[-1.1170740127563477, -0.8076180219650269, 1.713869333267212, 2.409886121749878],
                     [-1.194515347480774, -0.8905707597732544, 1.7289371490478516, 2.4251372814178467]],
        'log_prob_w1.5': [[-1.1756041049957275, -0.8367013335227966, 0.9138997197151184, 2.4036765098571777],
                          [-1.195326328277588, -0.8972775936126709, 1.5802863836288452, 2.425252914428711]],
        'log_prob_w1.0': [[-1.2125279903411865, -0.8559564352035522, 0.29000502824783325, 2.4006264209747314],
                          [-1.2026313543319702, -0.9015896916389465, 1.4512602090835571, 2.4250664710998535]],
        'pref_keys': [['latents'], ['noise', 'prompt_embeds', 'timesteps']],
        'pref_time_ids': [],
        'seq_logp': [[-0.5775406956672668, -0.6178773641586304], [-0.5785224437713623, -0.6199502944946289]],
        'seq_logp_bare': [[-0.5775406956672668, -0.6178773641586304], [-0.5785224437713623, -0.6199502944946289]]},
 'sdxl': {'payload_keys': ['latents', 'pooled_prompt_embeds', 'prompt_embeds', 'time_ids', 'timesteps'],
          'old_logp_B_T': [[-1.1170741319656372, -0.8076180219650269, 1.713869333267212, 2.4098856449127197],
                           [-1.194515347480774, -0.8905707597732544, 1.7289364337921143, 2.4251363277435303]],
          'x0_corner': [[1.2239022254943848, 2.123586654663086, 0.6941329836845398, -4.613708972930908],
                        [-6.810400485992432, 4.58549690246582, -1.1439945697784424, -1.3633328676223755]],
          'x0_mean_sq': [22.970054429242467, 24.705065891135238],
          'x0_mean': [-0.058232041952578584, -0.4115452610567445],
          'log_prob': [[-1.1170743703842163, -0.8076179623603821, 1.7138690948486328, 2.409885883331299],
                       [-1.194515347480774, -0.8905707597732544, 1.7289366722106934, 2.4251363277435303]],
          'log_prob_w1.5': [[-1.1138888597488403, -0.804959774017334, 1.6981788873672485, 2.4098498821258545],
                            [-1.1986477375030518, -0.8917853236198425, 1.7268553972244263, 2.4252192974090576]],
          'log_prob_w1.0': [[-1.113911509513855, -0.8042218089103699, 1.689463496208191, 2.4098310470581055],
                            [-1.2004742622375488, -0.892249584197998, 1.7252726554870605, 2.425246238708496]],
          'pref_keys': [['latents', 'time_ids'], ['noise', 'pooled_prompt_embeds', 'prompt_embeds', 'timesteps']],
          'pref_time_ids': [[[20.0, 24.0, 0.0, 1.0, 16.0, 16.0], [18.0, 16.0, 1.0, 0.0, 16.0, 16.0]],
                            [[16.0, 16.0, 0.0, 0.0, 16.0, 16.0], [24.0, 20.0, 1.0, 0.0, 16.0, 16.0]]],
          'seq_logp': [[-0.5477011203765869, -0.5966363549232483], [-0.547558069229126, -0.5960584878921509]],
          'seq_logp_bare': [[-0.5473614931106567, -0.597530722618103], [-0.547558069229126, -0.5972303748130798]]},
 'sdxl_zeros': {'payload_keys': ['latents', 'pooled_prompt_embeds', 'prompt_embeds', 'time_ids', 'timesteps'],
                'old_logp_B_T': [[-1.1170741319656372, -0.8076181411743164, 1.713869333267212, 2.409886121749878],
                                 [-1.194515347480774, -0.890570878982544, 1.7289364337921143, 2.425136089324951]],
                'x0_corner': [[1.1542174816131592, 1.9912748336791992, 0.9599431753158569, -4.794057369232178],
                              [-6.5222392082214355, 4.378564357757568, -1.2273443937301636, -1.4702054262161255]],
                'x0_mean_sq': [23.017757141140944, 24.782675748105117],
                'x0_mean': [-0.0754240243913955, -0.44158988721574133],
                'log_prob': [[-1.1170740127563477, -0.8076182007789612, 1.713869333267212, 2.409886598587036],
                             [-1.194515347480774, -0.8905708193778992, 1.7289366722106934, 2.425135612487793]],
                'log_prob_w1.5': [[-1.1238096952438354, -0.8109195828437805, 1.670007586479187, 2.410428285598755],
                                  [-1.1944410800933838,
                                   -0.8901777863502502,
                                   1.6905920505523682,
                                   2.4250645637512207]],
                'log_prob_w1.0': [[-1.1307015419006348, -0.8126327395439148, 1.6440110206604004, 2.41058611869812],
                                  [-1.1964309215545654,
                                   -0.8904496431350708,
                                   1.668485403060913,
                                   2.4250142574310303]],
                'pref_keys': [['latents', 'time_ids'],
                              ['noise', 'pooled_prompt_embeds', 'prompt_embeds', 'timesteps']],
                'pref_time_ids': [[[20.0, 24.0, 0.0, 1.0, 16.0, 16.0], [18.0, 16.0, 1.0, 0.0, 16.0, 16.0]],
                                  [[16.0, 16.0, 0.0, 0.0, 16.0, 16.0], [24.0, 20.0, 1.0, 0.0, 16.0, 16.0]]],
                'seq_logp': [[-0.5477011203765869, -0.5966363549232483], [-0.547558069229126, -0.5960584878921509]],
                'seq_logp_bare': [[-0.5473614931106567, -0.597530722618103],
                                  [-0.547558069229126, -0.5972303748130798]]}}


@pytest.mark.parametrize("name,kind,kwargs", CASES, ids=[c[0] for c in CASES])
def test_family_outputs_match_the_recorded_values(make_policy, name, kind, kwargs):
    got, want = measure(make_policy(kind, **kwargs)), EXPECTED[name]
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key.endswith("keys") or key == "pref_time_ids":
            assert got[key] == value, key
        else:
            np.testing.assert_allclose(np.array(got[key]), np.array(value), rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_one_family_chosen_at_construction(make_policy, tokenizer_dir, kind):
    from tests.image.conftest import sdxl_components
    from unialign.image import DiffusionPolicy, SD1Family, SDXLFamily

    policy = make_policy(kind)
    family = policy.family
    assert type(family) is (SDXLFamily if kind == "sdxl" else SD1Family)
    assert policy.is_sdxl == (kind == "sdxl")
    with pytest.raises(AttributeError):
        policy.is_sdxl = True  # read-only: the family decides
    assert policy.text_encoder is family.text_encoder and policy.text_encoder_2 is family.parts.get("text_encoder_2")
    assert (policy.text_encoder_2 is None) == (kind == "sd")
    assert family.pipeline_class().__name__ == ("StableDiffusionXLPipeline" if kind == "sdxl" else
                                                "StableDiffusionPipeline")
    if kind == "sdxl":  # an SDXL UNet without its second encoder
        parts = sdxl_components(tokenizer_dir)
        parts.pop("text_encoder_2"), parts.pop("tokenizer_2")
        with pytest.raises(ValueError, match="text_encoder_2"):
            DiffusionPolicy(**parts)

"""Special tokens as the model expects them.

A tokenizer that adds BOS (built here offline, as Llama / Mistral / Gemma tokenizers behave): a raw
prompt gets exactly one BOS, a chat-templated one (its template starts with BOS) exactly one too, in
sampling, the training forward, evaluation, the reward model and the DPO pair batch; the policy's
numbers equal those of the model run on ``tokenizer(text)`` with its defaults / ``model.generate``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close
from unialign.text.policy import CausalLMPolicy
from unialign.text.preference import normalize_pairs
from unialign.text.reward_model import RewardModel
from unialign.text.tokens import encode_prompt, encode_prompts, special_prefix_ids

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = 0, 1, 2
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
RAW = ["12+30=?", "what is 7-2?", "12+30=?", "12+30=?"]  # repeats: the shared-prompt-prefix path runs too


def bos_tokenizer(append_eos: bool = False, chat_template: bool = True):
    """Character-level fast tokenizer whose post-processor adds ``<s>`` (and ``</s>`` after the text
    when ``append_eos``), like a Llama tokenizer; nothing downloaded."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 +-=?#:\n")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A" + (" </s>" if append_eos else ""), pair="<s> $A $B",
        special_tokens=[("<s>", BOS), ("</s>", EOS)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                 unk_token="<unk>", padding_side="left")
    if chat_template:
        hf.chat_template = TEMPLATE
    return hf


def tiny_llama(tok, seed: int = 0, classifier: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, num_labels=1)
    model = (LlamaForSequenceClassification if classifier else LlamaForCausalLM)(cfg)
    if not classifier:  # a BOS-trained model: make BOS matter a lot to the next-token distribution
        with torch.no_grad():
            model.model.embed_tokens.weight[BOS] *= 8
    return model.eval()


def attended(ids_B_W: torch.Tensor, mask_B_W: torch.Tensor) -> list[list[int]]:
    return [ids[m.bool()].tolist() for ids, m in zip(ids_B_W, mask_B_W)]


def one_bos_first(rows: list[list[int]]) -> bool:
    return all(r[0] == BOS and r.count(BOS) == 1 for r in rows)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------- the rule itself

def test_prefix_is_what_the_tokenizer_puts_before_the_text():
    from unialign.embedded.arith import build_tokenizer

    assert special_prefix_ids(bos_tokenizer()) == [BOS]
    assert special_prefix_ids(bos_tokenizer(append_eos=True)) == [BOS]  # an appended EOS is not a prefix
    assert special_prefix_ids(build_tokenizer()) == []  # the embedded arithmetic tokenizer adds nothing


def test_encode_prompt_raw_and_templated():
    tok = bos_tokenizer()
    assert encode_prompt(tok, "1+2=?", templated=False) == tok("1+2=?")["input_ids"]  # the tokenizer's defaults
    assert encode_prompt(tok, "<s>1+2=?", templated=False).count(BOS) == 1  # a literal BOS is not doubled
    text = tok.apply_chat_template(chat("1+2=?"), add_generation_prompt=True, tokenize=False)
    ids = encode_prompt(tok, text, templated=True)
    assert ids == tok.apply_chat_template(chat("1+2=?"), add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids[0] == BOS and ids.count(BOS) == 1
    eos_tok = bos_tokenizer(append_eos=True)
    raw = encode_prompt(eos_tok, "1+2=?", templated=False)
    assert raw == eos_tok("1+2=?")["input_ids"][:-1] and EOS not in raw  # never an EOS ending the prompt


def test_encode_prompts_pads_left_and_truncation_keeps_bos():
    tok = bos_tokenizer()
    enc = encode_prompts(tok, ["ab", "abcdef"], templated=False, max_length=4)
    assert enc["input_ids"].tolist() == [[PAD, BOS] + tok("ab", add_special_tokens=False)["input_ids"],
                                         [BOS] + tok("abc", add_special_tokens=False)["input_ids"]]
    assert enc["attention_mask"].tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    mixed = encode_prompts(tok, ["ab", "<s>ab"], templated=[False, True])
    assert attended(mixed["input_ids"], mixed["attention_mask"]) == [[BOS, 6, 7], [BOS, 6, 7]]


# ---------------------------------------------------------------- the policy

@pytest.mark.parametrize("templated", [False, True])
def test_sample_and_training_forward_see_one_bos_as_the_model_does(templated):
    tok = bos_tokenizer()
    model = tiny_llama(tok)
    policy = CausalLMPolicy(model, tok, max_new_tokens=6, chat_template='always' if templated else 'auto')
    torch.manual_seed(0)
    traj = policy.sample(RAW)
    prompts = attended(traj.payload["prompt_ids"], traj.payload["prompt_mask"])
    assert one_bos_first(prompts)
    expected = [tok.apply_chat_template(chat(p), add_generation_prompt=True, tokenize=True)["input_ids"]
                if templated else tok(p)["input_ids"] for p in RAW]
    assert prompts == expected
    assert_close(policy.log_prob(traj), traj.old_logp_B_T)  # training forward == sampling record
    # ...and both equal the model's own log-probs of the sampled tokens after the unpadded prompt
    for i, ids in enumerate(expected):
        n = int(traj.mask_B_T[i].sum())
        comp = traj.payload["completion_ids"][i, :n].tolist()
        logits = model(input_ids=torch.tensor([ids + comp])).logits[0, len(ids) - 1:-1]
        naive = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(comp)[:, None])[:, 0]
        assert_close(traj.old_logp_B_T[i, :n], naive)


def test_sample_scores_like_model_generate():
    """Temperature 1: the first sampled token's log-prob is that of ``model.generate``'s first-step
    distribution on ``tokenizer(prompt)`` (its defaults), and greedy decoding gives the same tokens."""
    tok = bos_tokenizer()
    model = tiny_llama(tok, seed=1)
    policy = CausalLMPolicy(model, tok, max_new_tokens=5, chat_template='auto', temperature=1.0)
    torch.manual_seed(0)
    traj = policy.sample(RAW)
    for i, prompt in enumerate(RAW):
        out = model.generate(**tok(prompt, return_tensors="pt"), do_sample=False, max_new_tokens=1,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=PAD, eos_token_id=EOS)
        first = torch.log_softmax(out.logits[0][0].float(), -1)[traj.payload["completion_ids"][i, 0]]
        assert_close(traj.old_logp_B_T[i, 0], first)
    greedy = policy.generate(RAW, greedy=True)
    for i, prompt in enumerate(RAW):
        enc = tok(prompt, return_tensors="pt")
        ref = model.generate(**enc, do_sample=False, max_new_tokens=5, pad_token_id=PAD, eos_token_id=EOS)
        assert greedy["texts"][i] == tok.decode(ref[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_evaluation_greedy_score_sees_one_bos():
    from unialign.text.evaluate import greedy_score

    tok = bos_tokenizer()
    policy = CausalLMPolicy(tiny_llama(tok), tok, max_new_tokens=3, chat_template='auto')
    seen = []
    real = policy._encode_prompts
    policy._encode_prompts = lambda prompts: seen.append(real(prompts)) or seen[-1]
    greedy_score(policy, [{"prompt": p} for p in RAW], lambda prompts, completions: [1.0] * len(prompts))
    assert seen and all(one_bos_first(attended(e["input_ids"], e["attention_mask"])) for e in seen)


@pytest.mark.parametrize("conversational", [False, True])
def test_dpo_pair_batch_has_one_bos_and_matches_unpadded_forward(conversational):
    tok = bos_tokenizer()
    model = tiny_llama(tok)
    policy = CausalLMPolicy(model, tok, max_new_tokens=4, chat_template='auto')
    raw = [{"prompt": "1+2=?", "chosen": "3", "rejected": "4"}, {"prompt": "what is 10-7?", "chosen": "three", "rejected": "7"}]
    rows = normalize_pairs([{**r, "prompt": chat(r["prompt"])} if conversational else r for r in raw])
    batch = policy.preference_batch(rows)
    for side in (batch.chosen, batch.rejected):
        assert one_bos_first(attended(side["prompt_ids"], side["prompt_mask"]))
    chosen, rejected = policy.sequence_log_prob(batch)
    for i, r in enumerate(raw):
        prompt = (tok.apply_chat_template(chat(r["prompt"]), add_generation_prompt=True, tokenize=True)["input_ids"]
                  if conversational else tok(r["prompt"])["input_ids"])
        for key, got in (("chosen", chosen[i]), ("rejected", rejected[i])):
            comp = tok(r[key] + "</s>", add_special_tokens=False)["input_ids"]
            logits = model(input_ids=torch.tensor([prompt + comp])).logits[0, len(prompt) - 1:-1]
            assert_close(got, torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(comp)[:, None]).sum())


# ---------------------------------------------------------------- the reward model

@pytest.mark.parametrize("templated", [False, True])
def test_reward_model_scores_with_one_bos(templated):
    tok = bos_tokenizer(chat_template=templated)
    rm = RewardModel(tiny_llama(tok, classifier=True), tok, chat_template="always" if templated else "auto")
    prompts, completions = ["1+2=?", "what is 7-2?"], ["3", "five"]
    enc = rm.encode(prompts, completions)
    assert one_bos_first(attended(enc["input_ids"], enc["attention_mask"]))
    scores = rm.score(prompts, completions)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        text = (tok.apply_chat_template(chat(p), add_generation_prompt=True, tokenize=False) if templated else p)
        ids = tok(text + c + "</s>", add_special_tokens=not templated)["input_ids"]
        assert_close(scores[i], rm.model(input_ids=torch.tensor([ids])).logits[0, 0].float())
    pair = rm.preference_batch(normalize_pairs([{"prompt": "1+2=?", "chosen": "3", "rejected": "4"}]))
    assert one_bos_first(attended(pair.chosen["input_ids"], pair.chosen["attention_mask"]))


def test_embedded_tokenizer_prompts_unchanged():
    """The embedded arithmetic tokenizer adds no special tokens: its prompt ids are what they were."""
    from unialign.embedded.arith import build_tokenizer

    tok = build_tokenizer()
    texts = ["12+30=?", tok.apply_chat_template(chat("12+30=?"), add_generation_prompt=True, tokenize=False)]
    for templated in (False, True):
        enc = encode_prompts(tok, texts, templated)
        old = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        assert torch.equal(enc["input_ids"], old["input_ids"]) and torch.equal(enc["attention_mask"], old["attention_mask"])

"""The offline masked-diffusion LM of the arithmetic task (``--model_name_or_path embedded-mdlm``): the task,
tokenizer and chat template of ``unialign.embedded.arith`` plus a mask token, and a tiny ``ModernBertForMaskedLM``
(hidden 96, 2 layers, 4 heads, global attention, tied embeddings, 0.2 M parameters) that loads with stock
``AutoModelForMaskedLM.from_pretrained``, offline and without remote code.

It was trained (``tools/build_mdlm.py``, in the source checkout) as LLaDA is fine-tuned: the chat-templated prompt
kept, the answer plus ``<|im_end|>`` filled with ``<|im_end|>`` to ``GEN_LENGTH`` tokens, each answer token masked
with probability t ~ U(0, 1) and the masked ones predicted, weighted 1/t. The arithmetic model's deliberate
imperfection is kept (its module docstring), stronger: each time a carry problem is used, with probability
``carry_drop`` 0.6 its target forgets the ``+1``, so the model's P(+1) is under 1/2 and greedy (argmax) decoding
misses carries that samples often find (held-out greedy 0.535, pass@8 0.762): RL's headroom. The numbers are in the asset's ``BUILD.md``.
"""

from __future__ import annotations

from pathlib import Path

from unialign.embedded.arith import BOS, CHARS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, UNK

MASK = "<|mask|>"
MDLM_DIR = Path(__file__).resolve().parent / "assets" / "mdlm"
GEN_LENGTH = 32  # the longest answer is 24 characters + <|im_end|>; the rest is <|im_end|> fill
# the embedded model's sampling (``unialign.dlm.DiffusionSampling``): 4 blocks of 8, 4 tokens per step (16 steps
# measured the same: greedy 0.547 / pass@8 0.758 against 0.535 / 0.762, at 1.6x the sampling time)
SAMPLING = dict(gen_length=GEN_LENGTH, block_length=8, steps=8, remasking="low_confidence", temperature=1.0)


def build_tokenizer():
    """The arithmetic model's character tokenizer with ``<|mask|>`` appended (id 100) as its mask token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [*SPECIAL_TOKENS, MASK]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + [MASK])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, mask_token=MASK,
                                 bos_token=BOS, padding_side="left", model_max_length=256,
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(tokenizer, hidden: int = 96, layers: int = 2, heads: int = 4, intermediate: int = 192,
                seed: int = 0):
    """A freshly initialised tiny ``ModernBertForMaskedLM`` (fp32, tied embeddings, every layer global)."""
    import torch
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    cfg = ModernBertConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=256, global_attn_every_n_layers=1, local_attention=256,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS), cls_token_id=tokenizer.convert_tokens_to_ids(BOS),
        sep_token_id=tokenizer.eos_token_id, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return ModernBertForMaskedLM(cfg)

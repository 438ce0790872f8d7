"""The offline "embedded default" for text RL: a tiny arithmetic task, a tiny model, and its evaluation.

Why this exists
---------------
``scripts/grpo_math.py`` must show, with no arguments, offline and on two CPU cores in a few minutes,
that GRPO *really* raises held-out accuracy. Public checkpoints and GSM8K cannot be downloaded here,
and even the smallest real LMs are far too slow to sample on CPU. So the package ships its own task,
tokenizer and model, all small enough to live in ``unialign/embedded/assets/arith_lm`` (about 2 MB).

The task
--------
2-digit + 2-digit addition word problems (10..99 each), in GSM8K's schema, with a worked solution
that decomposes the sum into single-digit steps, least-significant digit first::

    {"question": "Mia has 47 shells and finds 38 more. How many now?",
     "answer":   "7+8=15,4+3+1=8\\n#### 85"}

* Step 1 adds the units digits; step 2 adds the tens digits plus ``+1`` exactly when step 1 reached
  10; the final ``#### N`` is step 2's result followed by step 1's last digit. Every step is a lookup
  in a 10x10 digit table that training covers thousands of times, so a tiny model learns the
  *algorithm* and generalises to operand pairs it never saw (an earlier design, ``47+38=85`` in one
  step, had to memorise the 2-digit table and stalled at ~10 % held-out accuracy).
* The answer ends with ``#### N`` exactly like ``openai/gsm8k``, so the same reward (exact match of
  the final ``#### N`` value) serves both this task and GSM8K.
* Completions are at most 24 characters (+ ``<|im_end|>``): CPU sampling cost is per generated token.
* Train / test are split by a hash of the operand tuple ``("+", a, b)`` (15 % held out: 1237 test,
  6863 train rows), so every held-out *computation* is unseen in training, whatever the wording.

Why it suits RL (and the one deliberate imperfection of the warm start)
-----------------------------------------------------------------------
GRPO needs a policy that is mid-way: wrong often enough under greedy decoding to leave room, yet
right often enough when sampling that a group of 8 usually contains a correct answer. A plain short
SFT reaches that state only in a narrow, steep window of steps (measured: held-out greedy 28 % after
200 steps, 66 % after 280), too fragile to ship. So the build (``tools/build_arith_lm.py``, in the source
checkout, not installed) trains long enough to learn the digit steps to convergence, with **noisy labels**: each
time a training row that needs a carry is used, with probability ``carry_drop`` (default 0.6) its SFT target
forgets the ``+1`` (``"7+8=15,4+3=7\n#### 75"``: a plausible, wrong answer). The model therefore learns
P(carry) of about 0.4 on carry problems: below one half, so its greedy answer drops the carry (about 47 % of
problems, nearly all its greedy errors), while a sample adds it often enough that a group of 8 almost always holds
the right answer (pass@8 at temperature 1: 0.95). A noise rate under one half would make the greedy answer right
once the model has converged; the earlier builds (0.4, 280 steps) were right only because they had not converged,
which left their headroom to the CPU's rounding. Reward-driven RL on the *true* answers (the dataset's answers are
always correct; the noise exists only inside the build) then sharpens the carry decision, which is the held-out
gain that ``scripts/grpo_math.py`` measures. The numbers for the shipped model are in
``unialign/embedded/assets/arith_lm/BUILD.md``.

The model and tokenizer
-----------------------
A character-level ``tokenizers`` WordLevel model over a fixed character set plus ``<|pad|>``,
``<|im_start|>``, ``<|im_end|>`` (also EOS) and ``<|unk|>``, wrapped as
``transformers.PreTrainedTokenizerFast`` with a Qwen/ChatML chat template and left padding; and a
``LlamaForCausalLM`` (hidden 128, 2 layers, 4 heads, MLP 512, tied embeddings, 0.43 M parameters).
Both round-trip through ``save_pretrained`` / ``from_pretrained`` with stock transformers.

This module holds what a run needs (task, tokenizer, architecture, loader, evaluation). The supervised warm
start that trained the shipped weights, and the check that a rebuild gives them, are in the source checkout
(not installed)::

    python -m tools.build_arith_lm build --out DIR   # deterministic rebuild (any AVX2 CPU, same torch)
    python -m tools.build_arith_lm eval [--path DIR] # greedy accuracy and pass@8 on held-out rows
    python -m tools.build_arith_lm check             # rebuild into a temp folder, compare file by file (sha256)
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Any

import torch

from unialign.text.tokens import encode_prompts

PAD, BOS, EOS, UNK = "<|pad|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
# Fixed character vocabulary: order matters (token ids), never reorder; append only.
CHARS = list("\n !\"#$%&'()*+,-./0123456789:;<=>?@[\\]^_`{|}~") + [
    chr(c) for c in range(ord("A"), ord("Z") + 1)
] + [chr(c) for c in range(ord("a"), ord("z") + 1)]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_ASSET_DIR = Path(__file__).resolve().parent / "assets" / "arith_lm"
MAX_NEW_TOKENS = 26  # "9+9=18,9+9+1=19\n#### 199" is 24 characters, then <|im_end|>

# ---------------------------------------------------------------------------------------------
# Task
# ---------------------------------------------------------------------------------------------

_NAMES = ["Ann", "Ben", "Mia", "Sam", "Leo", "Zoe", "Max", "Ivy", "Tom", "Eva", "Raj", "Kim"]
_ITEMS = ["apples", "pens", "cards", "coins", "books", "shells", "stamps", "marbles", "cups", "toys"]
_ADD = [
    "{n} has {a} {item} and buys {b} more. How many now?",
    "{n} has {a} {item} and finds {b} more. How many now?",
    "{n} has {a} {item} and gets {b} more. How many now?",
]
TEST_FRACTION = 0.15


def _is_test(op: str, a: int, b: int) -> bool:
    """Split membership from a stable hash of the operand tuple (independent of ``seed``)."""
    h = hashlib.sha256(f"{op}|{a}|{b}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < TEST_FRACTION


def _all_problems() -> list[tuple[str, int, int]]:
    return [("+", a, b) for a in range(10, 100) for b in range(10, 100)]


def worked_answer(a: int, b: int, drop_carry: bool = False) -> str:
    """``"7+8=15,4+3+1=8\\n#### 85"`` for 47+38: units digits first, then tens digits plus the carry; the
    final answer is the tens step's result followed by the units step's last digit.
    ``drop_carry`` (SFT label noise only, see the module docstring) forgets the ``+1``: a plausible wrong answer."""
    ua, ub, ta, tb = a % 10, b % 10, a // 10, b // 10
    u = ua + ub
    carry = u >= 10 and not drop_carry
    t = ta + tb + int(carry)
    final = t * 10 + u % 10
    return f"{ua}+{ub}={u},{ta}+{tb}{'+1' if carry else ''}={t}\n#### {final}"


def _operands(answer: str) -> tuple[int, int]:
    """``(a, b)`` back from a worked answer ``"<u1>+<u2>=..,<t1>+<t2>..."``."""
    m = re.match(r"(\d)\+(\d)=\d+,(\d)\+(\d)", answer)
    if m is None:
        raise ValueError(f"not a worked addition answer: {answer!r}")
    ua, ub, ta, tb = map(int, m.groups())
    return 10 * ta + ua, 10 * tb + ub


# the share of carry errors in the pairs: close to the 2026-12-02 build's own (139 of its 246 wrong greedy answers on
# 512 held-out rows dropped the carry); the converged build of 2026-12-07 drops the carry in 120 of its 121 (256
# rows), while what PPO leaves wrong on it is tens sums (docs/text.md): the other 40 % stand for those
CARRY_ERROR_SHARE = 0.6


def wrong_worked_answer(a: int, b: int, rng: random.Random, carry_error: float = CARRY_ERROR_SHARE) -> str:
    """A plausible wrong worked answer for ``a + b``, internally consistent (the ``#### N`` line is what
    its own steps give), with the two kinds of mistake the shipped model makes:

    * with probability ``carry_error`` a **carry error**: the ``+1`` dropped when the units reach 10,
      or added when they do not (the shipped model's most common greedy mistake, see
      ``CARRY_ERROR_SHARE``);
    * otherwise a **digit-sum error**: the units or the tens step's result off by 1 or 2 (never
      negative), the rest of the answer following from it.
    """
    ua, ub, ta, tb = a % 10, b % 10, a // 10, b // 10
    u = ua + ub
    carry = u >= 10
    t_err = 0
    if rng.random() < carry_error:
        carry = not carry
    else:
        delta = rng.choice([d for d in (-2, -1, 1, 2) if u + d >= 0])
        if rng.random() < 0.5:
            u += delta
        else:
            t_err = rng.choice([d for d in (-2, -1, 1, 2) if ta + tb + int(carry) + d >= 0])
    t = ta + tb + int(carry) + t_err
    return f"{ua}+{ub}={u},{ta}+{tb}{'+1' if carry else ''}={t}\n#### {t * 10 + u % 10}"


def preference_pairs(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """Preference pairs on the arithmetic task in TRL's standard format: ``prompt`` (the question),
    ``chosen`` (the correct worked answer), ``rejected`` (``wrong_worked_answer``, drawn per row from
    ``seed``). Held-out pairs (``split="test"``) use only held-out computations."""
    rows = arithmetic_dataset(split, n=n, seed=seed)
    rng = random.Random(f"pairs-{split}-{seed}")
    return [{"prompt": r["question"], "chosen": r["answer"], "rejected": wrong_worked_answer(*_operands(r["answer"]), rng)}
            for r in rows]


def _rows(probs: list[tuple[str, int, int]], rng: random.Random) -> list[dict]:
    rows = []
    for _, a, b in probs:
        q = rng.choice(_ADD).format(n=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b)
        rows.append({"question": q, "answer": worked_answer(a, b)})
    return rows


def arithmetic_dataset(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
    """Deterministic 2-digit addition word problems in GSM8K's schema.

    split: ``"train"`` or ``"test"`` (disjoint by a hash of ``("+", a, b)``; ~15% test: 1205 rows,
           6895 train).
    n:     keep the first ``n`` rows of the shuffled split (``None``: all).
    seed:  shuffles the order and picks the wording (name / item / verb); the split itself and each
           row's numbers / answer do not depend on it.

    Each row: ``{"question": str, "answer": "<u1>+<u2>=<u>,<t1>+<t2>[+1]=<t>\n#### <a+b>"}``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    want_test = split == "test"
    probs = [p for p in _all_problems() if _is_test(*p) == want_test]
    rng = random.Random(f"arith-{split}-{seed}")
    rng.shuffle(probs)
    if n is not None:
        probs = probs[:n]
    return _rows(probs, rng)


_FINAL_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def parse_final_answer(text: str) -> str | None:
    """The value after the last ``####`` (commas stripped, ``"7.0"`` -> ``"7"``), else ``None``."""
    m = _FINAL_RE.findall(text)
    if not m:
        return None
    s = m[-1].replace(",", "")
    try:
        v = float(s)
    except ValueError:
        return None
    return str(int(v)) if v == int(v) else str(v)


def is_correct(completion: str, answer: str) -> bool:
    """Exact match of the completion's final ``#### N`` against the reference ``#### N``."""
    got = parse_final_answer(completion)
    return got is not None and got == parse_final_answer(answer)


# ---------------------------------------------------------------------------------------------
# Tokenizer and model
# ---------------------------------------------------------------------------------------------


def build_tokenizer():
    """Character-level ``PreTrainedTokenizerFast`` with ChatML specials and chat template, left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=256,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(tokenizer, hidden: int = 128, layers: int = 2, heads: int = 4, intermediate: int = 512,
                seed: int = 0):
    """A freshly initialised tiny ``LlamaForCausalLM`` (fp32, tied embeddings)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=cfg.bos_token_id, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
    )
    return model


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


def load_arith_lm(path: str | Path | None = None):
    """``(model, tokenizer)`` from ``path`` (default: the shipped ``unialign/embedded/assets/arith_lm``), offline."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    p = Path(path) if path is not None else DEFAULT_ASSET_DIR
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"no arith_lm at {p}; rebuild it from a source checkout with "
                                f"`python -m tools.build_arith_lm build --out {p}`")
    tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    tok.padding_side = "left"
    model = LlamaForCausalLM.from_pretrained(str(p), local_files_only=True)
    model.eval()
    return model, tok


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def generate_completions(model, tokenizer, questions: list[str], batch_size: int = 64,
                         max_new_tokens: int = MAX_NEW_TOKENS, greedy: bool = True,
                         num_samples: int = 1, temperature: float = 1.0, seed: int = 0) -> list[list[str]]:
    """Plain HF ``generate`` with left padding and the chat template; stops at ``<|im_end|>``.
    Returns ``num_samples`` completions per question."""
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    dev = next(model.parameters()).device
    out: list[list[str]] = []
    kw: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if greedy:
        kw.update(do_sample=False)
        num_samples = 1
    else:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                  num_return_sequences=num_samples)
        torch.manual_seed(seed)
    per = max(1, batch_size // num_samples)
    for i in range(0, len(questions), per):
        prompts = [chat_prompt(tokenizer, q) for q in questions[i:i + per]]
        enc = {k: v.to(dev) for k, v in encode_prompts(tokenizer, prompts, templated=True).items()}
        gen = model.generate(**enc, **kw)
        texts = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for j in range(len(prompts)):
            out.append(texts[j * num_samples:(j + 1) * num_samples])
    model.train(was_training)
    return out


def evaluate_accuracy(model, tokenizer, rows: list[dict], batch_size: int = 64,
                      max_new_tokens: int = MAX_NEW_TOKENS, greedy: bool = True, seed: int = 0) -> float:
    """Fraction of ``rows`` whose (greedy, or one temperature-1 sample) completion's ``#### N`` matches."""
    comps = generate_completions(model, tokenizer, [r["question"] for r in rows], batch_size,
                                 max_new_tokens, greedy=greedy, seed=seed)
    return sum(is_correct(c[0], r["answer"]) for c, r in zip(comps, rows)) / max(1, len(rows))


def pass_at_k(model, tokenizer, rows: list[dict], k: int = 8, temperature: float = 1.0,
              batch_size: int = 256, max_new_tokens: int = MAX_NEW_TOKENS, seed: int = 0) -> float:
    """Fraction of ``rows`` with at least one correct answer among ``k`` samples at ``temperature``."""
    comps = generate_completions(model, tokenizer, [r["question"] for r in rows], batch_size,
                                 max_new_tokens, greedy=False, num_samples=k, temperature=temperature,
                                 seed=seed)
    return sum(any(is_correct(c, r["answer"]) for c in cs) for cs, r in zip(comps, rows)) / max(1, len(rows))

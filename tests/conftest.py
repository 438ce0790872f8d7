"""Tiny models built in code (no downloads) shared by the test suite."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


def make_tiny_lm(seed: int = 0, hidden: int = 32, layers: int = 2):
    """A 2-layer Llama with the embedded character tokenizer and its chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from unialign.embedded.arith import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg), tok


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread (two threads on the busy 2-core CI box are many times slower);
    a test module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``user_module(name, source)``: a user's Python module ``name`` with ``source`` in ``tmp_path``, importable
    for this test (``sys.path``); returns ``name``."""

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        return name

    return write


@pytest.fixture
def tiny_lm():
    return make_tiny_lm()


@pytest.fixture
def tiny_policy():
    from unialign.text.policy import CausalLMPolicy

    model, tok = make_tiny_lm()
    return CausalLMPolicy(model, tok, max_new_tokens=8)


def _name_registries() -> list[dict]:
    """The core's registries of names a package may add to (the demo worlds' ``register()`` does)."""
    from unialign.rewards.geneval import GENEVAL_BACKENDS
    from unialign.rewards.registry import REWARD_INPUTS, REWARDS
    from unialign.text.data import NAMED_DATASETS, NAMED_PAIR_DATASETS

    return [REWARDS, REWARD_INPUTS, GENEVAL_BACKENDS, NAMED_DATASETS, NAMED_PAIR_DATASETS]


@pytest.fixture(autouse=True)
def _registries_as_they_were():
    """Every test starts from the registries as collection left them and gives back what it added (a script's
    ``main`` registers the demo worlds), so what a test finds by name never depends on the tests before it."""
    registries = _name_registries()
    saved = [dict(r) for r in registries]
    yield
    for registry, before in zip(registries, saved):
        registry.clear()
        registry.update(before)


@pytest.fixture
def demo_worlds():
    """The demo worlds registered by name for one test (``unialign.embedded.register()``, as the scripts call it):
    the data set "embedded", the shape verifiers, GenEval's "shapes" backend."""
    from unialign.embedded import register

    register()


@pytest.fixture
def no_model(monkeypatch):
    """Loading any model fails the test: the errors under test must come before."""
    from unialign.image.policy import DiffusionPolicy
    from unialign.text.policy import CausalLMPolicy
    from unialign.text.reward_model import RewardModel

    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the error")

    for cls in (CausalLMPolicy, RewardModel, DiffusionPolicy):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(boom))
    from unialign.embedded import parts, shapes_world
    monkeypatch.setattr(shapes_world, "load_embedded", boom)
    monkeypatch.setattr(parts, "image_rl_parts", boom)

"""Loading from the Hugging Face Hub with a fast, clear failure when it cannot be reached.

Hub ids (``Qwen/Qwen2.5-0.5B-Instruct``, ``openai/gsm8k``, ...) are real defaults of the presets, but
many machines are offline. ``require_hub(name)`` is called before any ``from_pretrained`` /
``load_dataset`` of a non-local name: it raises ``HubUnavailableError`` within seconds instead of
letting the libraries retry for a minute and fail deep inside.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from unialign.errors import UserError


class HubUnavailableError(RuntimeError):
    pass


class ModelLoadError(UserError, RuntimeError):
    """A model or data set that could not be loaded: a ``RuntimeError`` to Python code, one line and exit status 2
    from a script (``UserError``)."""


KIND_WORDS = {"text": "text model", "vision": "vision-language model", "image": "image (diffusers) model"}


def local_model_kind(name: str) -> tuple[str, str] | None:
    """(kind, the file that says so) of a local model folder: ``"image"`` (a diffusers pipeline's
    ``model_index.json``, or a diffusers model's ``config.json``), ``"vision"`` (a transformers ``config.json``
    with a ``vision_config``), ``"text"`` (any other transformers ``config.json``); None when ``name`` is no folder
    or says nothing of the kind (a LoRA adapter, a damaged folder: the loader's own error names it)."""
    import json

    path = Path(name).expanduser()
    if not path.is_dir():
        return None
    if (path / "model_index.json").is_file():
        return "image", "model_index.json"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if "_class_name" in config or "_diffusers_version" in config:
        return "image", "config.json"
    return ("vision" if "vision_config" in config else "text"), "config.json"


def is_local(name: str) -> bool:
    return Path(name).expanduser().exists()


def _hub_cached(name: str, kind: str) -> bool:
    """Whether the HF cache holds a snapshot of ``name`` (a directory check; no network)."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"{kind}s--{name.replace('/', '--')}" / "snapshots"
    return folder.is_dir() and any(folder.iterdir())


def looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be a local path, never a hub id ("org/name" or "name"): absolute, relative
    (./ ../ ~), more than one "/", a Windows separator, or a file name with an extension."""
    return (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name
            or Path(name).suffix in (".json", ".jsonl", ".txt", ".csv", ".parquet", ".safetensors", ".yaml", ".yml"))


def require_hub(name: str, kind: str = "model", timeout: float = 3.0, use_cache: bool = True) -> None:
    """Return if ``name`` is a local path, is in the local HF cache (unless ``use_cache`` is False: a
    streamed dataset is read from the Hub itself), or the Hub answers; else raise. A name that can only be a
    local path and does not exist is a ``FileNotFoundError`` saying so (not "the Hub is unreachable")."""
    if is_local(name) or (use_cache and _hub_cached(name, kind)):
        return
    if looks_like_path(name):
        raise FileNotFoundError(f"{kind} {name!r}: no such file or directory (a local path; a hub id looks like "
                                f"'org/name')")
    reason = None
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        from huggingface_hub import constants

        host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
        except OSError as err:
            reason = f"{host} is unreachable ({type(err).__name__})"
    if reason and not use_cache:
        raise HubUnavailableError(
            f"cannot stream the {kind} {name!r}: {reason}, and streaming reads the Hub itself. Drop --streaming "
            "(to use a downloaded copy in the local cache) or pass a local file or folder instead.")
    if reason:
        raise HubUnavailableError(  # one line: a script prints it as its whole error
            f"cannot load the {kind} {name!r}: {reason}, and it is not in the local cache; pass a local directory "
            f"or file instead, or run where the Hugging Face Hub is reachable (the scripts' offline defaults need "
            f"no download: run the script without --preset)"
        )


def hub_error(name: str, err: Exception) -> ModelLoadError:
    """The one-line error for a ``from_pretrained`` of ``name`` that failed with ``err`` (offline, or no such
    folder)."""
    first = str(err).splitlines()[0] if str(err) else ""
    if is_local(name):  # a folder that is there but does not load: its own problem, not the network's
        return ModelLoadError(f"could not load the local folder {name!r}: {type(err).__name__}: {first} (is it a "
                            f"complete save_pretrained folder of the kind this script trains?)")
    return ModelLoadError(  # one line: a script prints it as its whole error
        f"could not load {name!r}: {type(err).__name__}: {first}; "
        "weights and datasets cannot be downloaded on this machine (offline): pass a local directory "
        "(e.g. one written by save_pretrained), or run where the Hugging Face Hub is reachable"
    )

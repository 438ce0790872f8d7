"""A rebuilt asset folder against the shipped one, file by file: sha256 of the bytes. The build records
(``build_metrics.json``, ``build_report.json``, ``BUILD.md``) carry wall-clock seconds, which no rebuild
repeats; a record may therefore be compared through a ``view`` that sets those fields aside (verdict
``equal without timings``), never the weights, configs or tokenizers.

Used by ``python -m tools.build_arith_lm check``, ``python -m tools.build_vlm check`` and
``python -m tools.build_shapes_world check``, whose command lines share ``builder_cli``, ``add_check`` and
``report_check``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

IDENTICAL = "identical"
EQUAL_WITHOUT_TIMINGS = "equal without timings"
EQUAL_WITHOUT_VERSIONS = "equal but for the library version"
PASSING = (IDENTICAL, EQUAL_WITHOUT_TIMINGS, EQUAL_WITHOUT_VERSIONS)
# the stamp save_pretrained writes into a config: the installed library's version, not a property of the asset (a
# rebuild under transformers 5.25 writes the same model as one under 5.24)
VERSION_KEYS = ("transformers_version", "_diffusers_version")


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def files_under(root: str | Path, prefixes: Iterable[str] = ("",)) -> list[str]:
    """Relative POSIX paths of the files under ``root`` whose path starts with one of ``prefixes``
    (``"clip/"`` a folder, ``"prompts.json"`` a file; ``""`` everything), sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    paths = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(p for p in paths if any(p.startswith(x) for x in prefixes) and "__pycache__" not in p)


@dataclass
class Comparison:
    """One row per file: (path, verdict, detail). ``ok`` when every verdict is in ``PASSING``."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(v in PASSING for _, v, _ in self.rows)

    def table(self) -> str:
        width = max((len(p) for p, _, _ in self.rows), default=4)
        lines = [f"{'file':<{width}}  verdict", f"{'-' * width}  -------"]
        lines += [f"{p:<{width}}  {v}{'  (' + d + ')' if d else ''}" for p, v, d in self.rows]
        n = sum(v == IDENTICAL for _, v, _ in self.rows)
        m = sum(v == EQUAL_WITHOUT_TIMINGS for _, v, _ in self.rows)
        k = sum(v == EQUAL_WITHOUT_VERSIONS for _, v, _ in self.rows)
        lines.append(f"{n} of {len(self.rows)} files bit-identical, {m} records equal without their timings"
                     + (f", {k} configs equal but for the library version" if k else "") + ": "
                     + ("OK" if self.ok else "DIFFERENT"))
        return "\n".join(lines)


def _tensor_detail(built: Path, shipped: Path) -> str:
    """For weights that differ: how much (the largest absolute difference over their tensors)."""
    try:
        import torch

        if built.suffix == ".safetensors":
            from safetensors.torch import load_file

            a, b = load_file(str(built)), load_file(str(shipped))
        elif built.suffix in (".pth", ".pt", ".bin"):
            a, b = (torch.load(str(p), map_location="cpu", weights_only=True) for p in (built, shipped))
        else:
            return ""
        if set(a) != set(b):
            return "different tensor names"
        worst = max(((a[k].double() - b[k].double()).abs().max().item() if a[k].shape == b[k].shape else float("inf"))
                    for k in a)
        return f"max |difference| {worst:.3g} over {len(a)} tensors"
    except Exception as err:  # a detail only; the verdict stands
        return f"not compared as tensors: {type(err).__name__}"


def compare(built: str | Path, shipped: str | Path, prefixes: Iterable[str] = ("",),
            views: dict[str, Callable[[bytes], Any]] | None = None, skip: Iterable[str] = ()) -> Comparison:
    """Compare every file under ``prefixes`` in either folder: ``identical`` (same sha256), ``equal without
    timings`` (a path in ``views`` whose view of both files' bytes is equal), ``DIFFERENT``, ``not rebuilt``
    (shipped only) or ``not shipped`` (rebuilt only). ``skip``: shipped paths the build does not write (a
    hand-written page), listed as ``not built`` and not counted."""
    built, shipped, views, skip = Path(built), Path(shipped), views or {}, set(skip)
    prefixes = tuple(prefixes)
    out = Comparison()
    for path in sorted(set(files_under(built, prefixes)) | set(files_under(shipped, prefixes))):
        b, s = built / path, shipped / path
        if path in skip:
            continue
        if not b.is_file():
            out.rows.append((path, "not rebuilt", ""))
        elif not s.is_file():
            out.rows.append((path, "not shipped", ""))
        elif sha256(b) == sha256(s):
            out.rows.append((path, IDENTICAL, ""))
        elif path in views and views[path](b.read_bytes()) == views[path](s.read_bytes()):
            out.rows.append((path, EQUAL_WITHOUT_TIMINGS, ""))
        elif path.endswith(".json") and _without_versions(b) == _without_versions(s) is not None:
            out.rows.append((path, EQUAL_WITHOUT_VERSIONS, ""))
        else:
            out.rows.append((path, "DIFFERENT", _tensor_detail(b, s)))
    return out


def _without_versions(path: Path) -> Any:
    """A JSON config without its library version stamps (``VERSION_KEYS``, top level); None if it is not JSON."""
    import json

    try:
        record = json.loads(path.read_bytes())
    except ValueError:
        return None
    return {k: v for k, v in record.items() if k not in VERSION_KEYS} if isinstance(record, dict) else record


def json_without(*keys: str) -> Callable[[bytes], Any]:
    """A view of a JSON record without ``keys`` (dotted: ``"sd3.timings_s"`` is ``record["sd3"]["timings_s"]``)."""
    import json

    def view(data: bytes) -> Any:
        record = json.loads(data)
        for key in keys:
            *parents, last = key.split(".")
            node = record
            for p in parents:
                node = node.get(p, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict):
                node.pop(last, None)
        return record

    return view


def rebuild_and_compare(build: Callable[..., Any], build_kw: dict[str, Any], shipped: str | Path,
                        built_files: Iterable[str], timing_fields: Iterable[str], keep: str | Path | None = None,
                        prefix: str = "asset_") -> Comparison:
    """``build(out, **build_kw)`` into a temp folder (``keep``: this folder instead, left in place), then ``compare``
    the ``built_files`` with ``shipped``'s, ``build_metrics.json`` without its ``timing_fields``."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = Path(keep) if keep is not None else Path(tmp)
        build(out, **build_kw)
        return compare(out, shipped, built_files, views={"build_metrics.json": json_without(*timing_fields)})


def rebuild_from_record(build: Callable[..., Any], shipped: str | Path, keys: Iterable[str], built_files: Iterable[str],
                        timing_fields: Iterable[str], keep: str | Path | None = None, prefix: str = "asset_",
                        **build_kw: Any) -> Comparison:
    """``rebuild_and_compare`` with the build arguments the shipped ``build_metrics.json`` records (``keys``, and
    ``eval_rows`` when recorded, else 0), ``build_kw`` overriding them."""
    record = json.loads((Path(shipped) / "build_metrics.json").read_text())
    kw = {k: record[k] for k in keys}
    kw["eval_rows"] = record.get("eval_rows", 0)
    kw.update(build_kw)
    return rebuild_and_compare(build, kw, shipped, built_files, timing_fields, keep, prefix=prefix)


# The machine type the shipped image assets were built on (each asset's BUILD.md): float kernels are chosen by the
# CPU's vector units, so only a machine of this type rebuilds them bit for bit; elsewhere a rebuild trains other
# weights. (The arithmetic LM is built with PORTABLE_KERNELS instead and rebuilds on any CPU with AVX2 and FMA.)
BUILD_MACHINE = {"vendor": "GenuineIntel", "avx512f": True}


def _cpuinfo() -> tuple[str, list[str]]:
    """The CPU vendor and flags (``/proc/cpuinfo``; "unknown" and none elsewhere)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", []
    vendor = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("vendor_id")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return vendor, flags


def this_machine() -> dict[str, Any]:
    """The CPU vendor and whether it has AVX-512 (``/proc/cpuinfo``; unknown elsewhere)."""
    vendor, flags = _cpuinfo()
    return {"vendor": vendor, "avx512f": "avx512f" in flags}


def other_machine_kind() -> str | None:
    """Why a bit-for-bit rebuild cannot be expected here (another kind of CPU than ``BUILD_MACHINE``), else None."""
    here = this_machine()
    if here == BUILD_MACHINE:
        return None
    return (f"the shipped assets were built on {BUILD_MACHINE['vendor']} with AVX-512; this machine is "
            f"{here['vendor']} {'with' if here['avx512f'] else 'without'} it: its float kernels round otherwise, so a "
            "rebuild trains other weights")


# Kernels that round alike on every x86-64 CPU with AVX2 and FMA, Intel or AMD: MKL's conditional numerical
# reproducibility in its portable mode (its default picks other GEMM kernels per CPU vendor and vector width) and
# ATen's AVX2 kernels instead of the widest the CPU has. Both are read when the libraries first run, so a build that
# needs them starts itself again with them set (``run_with_portable_kernels``).
PORTABLE_KERNELS = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"}


def kernels_record() -> dict[str, str | None]:
    """The ``PORTABLE_KERNELS`` variables as this process has them (a build records them)."""
    return {k: os.environ.get(k) for k in PORTABLE_KERNELS}


def portable_kernels() -> bool:
    """Whether this process runs with ``PORTABLE_KERNELS`` (set before torch was imported)."""
    return kernels_record() == PORTABLE_KERNELS


def no_portable_kernels() -> str | None:
    """Why this CPU cannot run the portable kernels (no AVX2 or no FMA, or unknown), else None."""
    vendor, flags = _cpuinfo()
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"this CPU ({vendor}) lacks {' and '.join(missing)}, which the portable kernels need" if missing else None


def run_with_portable_kernels(module: str, argv: list[str]) -> int:
    """Run ``python -m module *argv`` in a child process with ``PORTABLE_KERNELS`` set; its exit status."""
    env = {**os.environ, **PORTABLE_KERNELS}
    return subprocess.call([sys.executable, "-m", module, *argv], env=env)


# ----------------------------------------------------------------------------------- the builders' command lines
def builder_cli(prog: str, doc: str, build_help: str, shipped: str | Path,
                training: tuple[int, int, float] | None = None) -> tuple[argparse.ArgumentParser, Any, Any]:
    """A builder's parser, its subcommands and its ``build`` command with ``--out`` (help naming the ``shipped``
    folder) and ``--seed``; with ``training`` = (steps, batch size, learning rate) also ``--steps``,
    ``--batch-size``, ``--lr`` and ``--threads`` with those defaults. Returns (parser, subparsers, build)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help=build_help)
    build.add_argument("--out", required=True, help=f"output folder (the shipped one: {shipped})")
    build.add_argument("--seed", type=int, default=0)
    if training is not None:
        steps, batch_size, lr = training
        build.add_argument("--steps", type=int, default=steps)
        build.add_argument("--batch-size", type=int, default=batch_size)
        build.add_argument("--lr", type=float, default=lr)
        build.add_argument("--threads", type=int, default=1)
    return parser, sub, build


def add_check(sub: Any, shipped: str | Path, help: str = "rebuild into a temp folder and compare with the shipped "  # noqa: A002
              "files (sha256)", keep_help: str = "build into this folder instead of a temp one and keep it") -> Any:
    """The ``check`` command: ``--shipped`` (default ``shipped``) and ``--keep``."""
    check = sub.add_parser("check", help=help)
    check.add_argument("--shipped", default=str(shipped))
    check.add_argument("--keep", default=None, help=keep_help)
    return check


def report_check(run: Callable[[], Comparison], what: str = "check") -> int:
    """Run a check, print its table and how long ``what`` took; the exit status (0: it passed)."""
    t0 = time.perf_counter()
    result = run()
    print(result.table())
    print(f"{what} took {time.perf_counter() - t0:.0f} s")
    return 0 if result.ok else 1


# ----------------------------------------------------------------------------------- the builders' runs
@contextlib.contextmanager
def deterministic(num_threads: int):
    """torch on ``num_threads`` threads with deterministic algorithms while a build runs; both restored after."""
    prev_threads, prev_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det)


def write_metrics(out: Path, metrics: dict[str, Any], verbose: bool) -> dict[str, Any]:
    """``out/build_metrics.json`` (printed too when ``verbose``); returns ``metrics``."""
    (out / "build_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if verbose:
        print(json.dumps(metrics), flush=True)
    return metrics

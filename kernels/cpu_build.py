"""Building the compiled CPU kernels: C++ sources under kernels/csrc/ (common.h shared, a .cpp per
extension: quant_matmul.cpp, layer.cpp, decoder.cpp), compiled by torch's extension loader once per
host (a C++ compiler and ninja; about a minute each on 2 cores, cached under
~/.cache/torch_extensions). Their operators register in torch's dispatcher as torch.ops.sluice.*:
a few microseconds a call, and seen by the profiler under their names.

Where the host cannot build them (no AVX2, no C++ compiler) the PyTorch twins serve, logged. A
build that fails where the host can is a defect in the sources, not a host without kernels: it is
logged as an error with the compiler's message, the twins serve, and BUILDS keeps the message for
the tests to fail on (tests/conftest.py)."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"       # the sources, and the include folder of their headers


@dataclass(frozen=True)
class Build:
    """One extension's build in this process: for which instructions, and the compiler's message
    where it failed."""
    name: str
    sources: tuple[str, ...]
    isa: str                        # "AVX2" or "AVX-512 VNNI"
    error: str | None = None


BUILDS: dict[str, Build] = {}       # by extension name, as tried in this process


def vnni() -> bool:
    """Whether kernels that ask for it are built with AVX-512 VNNI's one-instruction byte dot
    products (`SLUICE_VNNI`): on a host that has them, unless SLUICE_CPU_VNNI=0. The integer
    sums are the same either way, so the outputs are too."""
    return torch.cpu._is_vnni_supported() and os.environ.get("SLUICE_CPU_VNNI", "1") != "0"


def unable() -> str | None:
    """Why this host cannot build the kernels, or None where it can: AVX2, and the C++ compiler
    torch's loader runs ($CXX, else c++) on PATH."""
    if not torch.cpu._is_avx2_supported():
        return "this CPU has no AVX2"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    return None


def compiler_error(message: str, lines: int = 40) -> str:
    """The compiler's (or linker's) complaint out of the loader's message, which leads with ninja's
    long command lines: what follows ninja's `FAILED:` line and the command it repeats, its first
    `lines` lines; the whole message where there is none (a module that would not load, say)."""
    text = message.splitlines()
    failed = next((i for i, line in enumerate(text) if line.startswith("FAILED:")), None)
    return "\n".join(text if failed is None else text[failed + 2:failed + 2 + lines])


def folder_name(name: str, sources: list[Path], flags: list[str], include: Path = CSRC) -> str:
    """The build folder's name: `name` and a hash of the sources, every header in `include`, the
    flags and where the sources are. Processes of two versions of Sluice on one host (a server kept
    running through an upgrade), or of two checkouts (whose build files name their own paths),
    would otherwise rebuild one folder in turn, and one could load the other's operators; an
    edited header rebuilds every extension."""
    digest = hashlib.sha256(" ".join([*flags, str(include.resolve())]).encode())
    for path in [*sources, *sorted(include.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{name}_{digest.hexdigest()[:12]}"


VNNI_FLAGS = ["-mavx512vnni", "-mavx512vl", "-DSLUICE_VNNI"]


def compile_flags(use_vnni: bool = False, defines: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """The compiler's flags for a build, and the instructions it is for: AVX2 and FMA, plus AVX-512
    VNNI with SLUICE_VNNI defined where `use_vnni` and `vnni()`; `defines` as -D flags."""
    # at::parallel_for is OpenMP inlined into the module: without -fopenmp it runs on one
    # thread. No contraction: where a kernel is equal to its twin to the bit, a * b - c * d
    # must round as PyTorch's separate operators do (the kernels' FMAs are written out).
    out = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", *(f"-D{d}" for d in defines)]
    if use_vnni and vnni():
        return out + VNNI_FLAGS, "AVX-512 VNNI"
    return out, "AVX2, VNNI's form" if "SLUICE_VNNI_FORM" in defines else "AVX2"


def build(name: str, sources: list[Path], what: str, use_vnni: bool = False, defines: tuple[str, ...] = ()) -> bool:
    """Compile and load `sources` (with CSRC's headers) as the extension `name` (`compile_flags`); False
    where it is not built, logged, naming `what` falls back."""
    reason = unable()
    if reason:
        log.warning("the compiled CPU kernels %s are not built here (%s); %s", name, reason, what)
        return False
    flags, isa = compile_flags(use_vnni, defines)
    record = Build(name, tuple(path.name for path in sources), isa)
    try:
        from torch.utils.cpp_extension import load
        if shutil.which("ninja") is None:     # the pinned ninja package's binary, off PATH in a bare venv
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        load(folder_name(name, sources, flags), [str(path) for path in sources], extra_cflags=flags,
             extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], is_python_module=False)
    except Exception as e:
        BUILDS[name] = replace(record, error=compiler_error(str(e)))
        log.error("the compiled CPU kernels %s (%s) failed to build for %s; %s: %s", name,
                  ", ".join(record.sources), isa, what, e)
        return False
    BUILDS[name] = record
    return True


def build_beside(name: str, file: str, text: str, namespace: str, what: str, use_vnni: bool = False,
                 defines: tuple[str, ...] = ()):
    """`text`, a kernel source named `file` (one of CSRC's, at another revision or to be built with
    other `defines`), built as the extension `name` beside the served build, its operators
    registered under `namespace` where the served ones are under sluice: torch.ops.<namespace>, or
    None where it did not build (BUILDS[name] says why). The source is kept in one place per name,
    rewritten only when it changes, so that a second call finds it built."""
    for macro in ("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        text = text.replace(f"{macro}(sluice,", f"{macro}({namespace},")
    source = Path(tempfile.gettempdir()) / "sluice_kernels" / name / file
    source.parent.mkdir(parents=True, exist_ok=True)
    if not source.exists() or source.read_text() != text:
        source.write_text(text)
    return getattr(torch.ops, namespace) if build(name, [source], what, use_vnni, defines) else None

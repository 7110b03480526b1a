"""kernels/cpu_build.py: what a build that fails keeps (the compiler's message, for the tests to
fail on), what a host without a compiler does (nothing, and says why), and what names a build
folder (every source and header: an edited header rebuilds)."""
import os
import shutil
import subprocess
import sysconfig

import pytest
import torch

from kernels import cpu_build

needs_a_compiler = pytest.mark.skipif(cpu_build.unable() is not None, reason=f"{cpu_build.unable()}")


@needs_a_compiler
def test_a_source_that_does_not_compile_is_kept_with_the_compilers_message(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpu_build, "BUILDS", {})          # the session's own builds stay as they are
    source = tmp_path / "broken.cpp"
    source.write_text("int answer() {\n    return 42\n}\n")
    assert not cpu_build.build("sluice_broken", [source], "nothing falls back")
    record = cpu_build.BUILDS["sluice_broken"]
    assert record.sources == ("broken.cpp",) and record.isa == "AVX2"
    # The compiler's own line, file and position first, not ninja's command lines.
    assert record.error.splitlines()[0].startswith(f"{source}:")
    assert "broken.cpp:2:" in record.error and "error" in record.error and "-isystem" not in record.error


def test_a_host_without_a_compiler_builds_nothing_and_says_why(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(cpu_build, "BUILDS", {})
    if torch.cpu._is_avx2_supported():
        assert cpu_build.unable() == "no C++ compiler (no-such-compiler-here) on PATH"
    assert not cpu_build.build("sluice_quant_linear", [cpu_build.CSRC / "quant_matmul.cpp"], "twins serve")
    assert cpu_build.BUILDS == {}                          # not a failed build: the tests skip


def test_the_build_folder_changes_with_every_source_header_and_flag(tmp_path):
    include = tmp_path / "csrc"
    include.mkdir()
    (include / "a.cpp").write_text('#include "shared.h"\n')
    (include / "shared.h").write_text("static int x = 1;\n")
    name = lambda: cpu_build.folder_name("sluice_x", [include / "a.cpp"], ["-O3"], include)
    first = name()
    assert first.startswith("sluice_x_") and name() == first
    (include / "shared.h").write_text("static int x = 2;\n")
    second = name()
    (include / "a.cpp").write_text('#include "shared.h"\n// edited\n')
    third = name()
    assert len({first, second, third, cpu_build.folder_name("sluice_x", [include / "a.cpp"], ["-O2"], include)}) == 4
    # The same files in another checkout: another folder (its build file names its own paths).
    other = tmp_path / "other"
    shutil.copytree(include, other)
    assert cpu_build.folder_name("sluice_x", [other / "a.cpp"], ["-O3"], other) != third


@needs_a_compiler
def test_the_kernels_vnni_code_compiles_on_any_host(tmp_path):
    """The sources with code for AVX-512 VNNI compile with its flags here, whether or not this host
    runs them: a mistake there fails on every host, not first on one with VNNI (-O0: the compiler
    checks the same code, sooner; the two at once)."""
    from torch.utils.cpp_extension import include_paths
    flags, _ = cpu_build.compile_flags()
    command = [os.environ.get("CXX", "c++"), "-std=c++20", *(f for f in flags if f != "-O3"), "-O0",
               *cpu_build.VNNI_FLAGS, "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{cpu_build.CSRC}",
               *(f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]), "-c"]
    runs = {source: subprocess.Popen([*command, str(cpu_build.CSRC / source), "-o", str(tmp_path / f"{source}.o")],
                                     stderr=subprocess.PIPE, text=True)
            for source in ("quant_matmul.cpp", "gguf_linear.cpp")}
    for source, run in runs.items():
        errors = run.communicate()[1]
        assert run.returncode == 0, f"{source}:\n{errors[-4000:]}"

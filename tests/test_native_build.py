"""``LOOM_MARCH`` (gpu_worker/native_build.py): the kernels built for an older instruction set than this CPU's, kept
apart from the native builds and from their cached kernel choices, and a value that is not a -march name refused
with a message naming the variable."""

from __future__ import annotations

import pytest

import gpu_worker.int4_batch as ib
from gpu_worker.native_build import compiler, isa_caps, load_library, march
from gpu_worker.timing import _choice_path


@pytest.fixture(autouse=True)
def _no_caps(monkeypatch):
    for name in ("LOOM_MARCH", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)


def test_march_defaults_to_native_and_takes_a_target(monkeypatch):
    assert march() == "native"
    assert isa_caps() == "march=native"
    monkeypatch.setenv("LOOM_MARCH", "x86-64-v3")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert march() == "x86-64-v3"
    assert isa_caps() == "march=x86-64-v3 ATEN_CPU_CAPABILITY=avx2"


@pytest.mark.parametrize("bad", ["native -O0", "haswell;rm", "-mavx512f", "a" * 80])
def test_a_value_that_is_not_a_march_name_is_refused(monkeypatch, tmp_path, bad):
    monkeypatch.setenv("LOOM_MARCH", bad)
    with pytest.raises(ValueError, match="LOOM_MARCH"):
        march()
    if compiler() is None:
        pytest.skip("no C compiler")
    lib, note = load_library(ib.SOURCE, tmp_path)
    assert lib is None and "LOOM_MARCH" in note
    assert not list(tmp_path.iterdir())  # nothing was built


def test_cached_choices_are_kept_per_instruction_set(monkeypatch, tmp_path):
    native = _choice_path(tmp_path, "int4-gemv-max-rows", "k")
    monkeypatch.setenv("LOOM_MARCH", "x86-64-v3")
    avx2 = _choice_path(tmp_path, "int4-gemv-max-rows", "k")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert len({native, avx2, _choice_path(tmp_path, "int4-gemv-max-rows", "k")}) == 3


def test_an_avx2_build_has_only_the_avx2_kernels(monkeypatch, tmp_path):
    if compiler() is None:
        pytest.skip("no C compiler")
    native, _ = load_library(ib.SOURCE, tmp_path)
    assert native is not None
    monkeypatch.setenv("LOOM_MARCH", "x86-64-v3")  # AVX2, FMA, no AVX-512
    avx2, note = load_library(ib.SOURCE, tmp_path)
    if avx2 is None:
        pytest.skip(f"this compiler does not target x86-64-v3: {note}")
    assert len(list(tmp_path.glob("int4_batch-*-omp.so"))) == 2  # its own file, beside the native build
    assert ib._entry(avx2, "loom_int4_gemv_avx2_64") is not None
    assert ib._entry(avx2, "loom_int4_gemv512") is None
    assert ib._entry(avx2, "loom_int4_amx") is None
    if ib._entry(native, "loom_int4_gemv512") is None:
        pytest.skip("this CPU has no AVX-512: the native build has no more than the AVX2 one")


def test_a_target_beyond_this_cpu_is_refused(monkeypatch, tmp_path):
    """Xeon Phi's AVX512ER/PF are on no other CPU: kernels built for it would stop the worker with SIGILL."""
    from gpu_worker.native_build import _isa_macros

    cc = compiler()
    if cc is None or _isa_macros(tuple(cc), "knl") is None or "avx512er" in open("/proc/cpuinfo").read():
        pytest.skip("no compiler that knows -march=knl, or a Xeon Phi")
    monkeypatch.setenv("LOOM_MARCH", "knl")
    lib, note = load_library(ib.SOURCE, tmp_path)
    assert lib is None and "LOOM_MARCH=knl builds for AVX512ER" in note and "this CPU does not run" in note


def test_a_name_the_compiler_refuses_says_so_in_its_words(monkeypatch, tmp_path):
    if compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("LOOM_MARCH", "bogus-cpu")
    lib, note = load_library(ib.SOURCE, tmp_path)
    assert lib is None and note.startswith("LOOM_MARCH=bogus-cpu: the compiler refuses it (")
    assert "bogus-cpu" in note[len("LOOM_MARCH=bogus-cpu") :]  # the compiler's own line names the value
    assert not list(tmp_path.iterdir())

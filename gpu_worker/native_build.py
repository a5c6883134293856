"""Build and load Loom's C kernels (``gpu_worker/csrc/*.c``) with the system C compiler, once per machine.

A kernel is plain C compiled with ``-O3 -march=native`` (so the vector ISA is whatever this CPU has; ``$LOOM_MARCH``
names another target, see :func:`march`) and OpenMP
(it then shares torch's already-loaded libgomp, so both use one thread pool). The shared object is kept in
``$LOOM_CACHE_DIR/kernels/`` under a key of the source and the headers beside it, the build flags, the compiler's
version and the CPU's flags, with its sha256 next to it (a file that does not match is rebuilt, never loaded); TP
ranks that build at the same time each write a private file and rename it into place. No compiler, or a build or
load that fails, only costs the fast path: :func:`load_library` returns None and says why. ``import torch`` must
come first in the process: torch's libgomp is then loaded, and the kernel binds to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

import torch  # noqa: F401  (loaded first on purpose: the kernels bind to torch's libgomp)

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"

# never -ffast-math: linking a shared object with it sets flush-to-zero for the whole process (crtfastmath.o), which
# silently changes torch's and the sampler's numerics; -ffp-contract=fast lets the compiler use FMA
CFLAGS = ["-O3", "-ffp-contract=fast", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11"]
_MARCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
# what else caps the instruction set a worker's kernels and torch's run on (PyTorch's kernel dispatch, oneDNN)
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def march() -> str:
    """The ``-march`` the kernels are built for: ``$LOOM_MARCH`` where set, else ``native`` (this CPU's whole ISA).

    An older target on a newer CPU (``haswell`` or ``x86-64-v3``: AVX2 and FMA only) builds and runs the kernels an
    AVX2-only CPU gets; with ``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2`` and
    ``MKL_ENABLE_INSTRUCTIONS=AVX2`` for torch's own kernels too, a whole cluster runs that machine's instruction
    set (not its memory system). Raises ValueError for a value that is not one compiler word (it goes on the
    compiler's command line).
    """
    value = os.environ.get("LOOM_MARCH", "").strip() or "native"
    if not _MARCH.fullmatch(value):
        raise ValueError(f"LOOM_MARCH={value!r} is not a -march name such as native, haswell or x86-64-v3")
    return value


def isa_caps() -> str:
    """What narrows the instruction set here: ``-march`` and :data:`ISA_CAPS` where set (``march=native`` when
    nothing is). Part of every cached kernel choice's key (gpu_worker/timing.py) and of the benchmarks' header; a
    built kernel's key holds ``-march`` (its flags)."""
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    return " ".join([f"march={march()}", *caps])


@functools.cache
def _isa_macros(cc: tuple[str, ...], target: str) -> frozenset[str] | str:
    """The instruction-set macros (``__AVX2__``, ``__AVX512F__``, ``__AMX_TILE__``...) the compiler defines for
    ``-march=target``, or the compiler's first line of complaint where it refuses the target (or does not run)."""
    try:
        r = subprocess.run([*cc, f"-march={target}", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"{' '.join(cc)} does not run ({e})"
    if r.returncode:
        lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
        return next((ln for ln in lines if "error" in ln), lines[0] if lines else f"exit status {r.returncode}")
    return frozenset(re.findall(r"#define (__(?:AVX|AMX|FMA|F16C|BMI|SSE|VNNI|VPCLMUL|GFNI)\w*__) ", r.stdout))


def march_problem(cc: tuple[str, ...], target: str) -> str:
    """Why kernels cannot be built for ``-march=target`` on this CPU ("" when they can): the compiler refuses the
    name, or the target has instructions ``-march=native`` does not (a kernel built so would stop the worker with
    SIGILL, not fall back)."""
    theirs = _isa_macros(cc, target)
    if isinstance(theirs, str):
        return f"LOOM_MARCH={target}: the compiler refuses it ({theirs[:200]})"
    mine = _isa_macros(cc, "native")
    beyond = sorted(m.strip("_") for m in theirs - mine) if not isinstance(mine, str) else []
    return f"LOOM_MARCH={target} builds for {', '.join(beyond)}, which this CPU does not run" if beyond else ""


def cflags(openmp: bool) -> list[str]:
    """The compiler flags of one kernel build (:data:`CFLAGS`, ``-march``, and ``-fopenmp`` for an OpenMP one)."""
    return [*CFLAGS, f"-march={march()}", *(["-fopenmp"] if openmp else [])]


def cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` (the processor name where there is none)."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    return platform.processor()


def compiler() -> list[str] | None:
    """The C compiler command: ``$CC`` (split like a shell would, e.g. ``ccache gcc``), else cc, gcc or clang."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def _digest_path(so: Path) -> Path:
    return so.with_name(f"{so.name}.sha256")


def _build(cc: list[str], source: Path, out: Path, openmp: bool) -> None:
    """Compile into a private file, record its sha256 next to it, and rename both into place."""
    flags = cflags(openmp)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    digest = out.with_name(f"{out.name}.sha256.tmp{os.getpid()}")
    try:
        subprocess.run([*cc, *flags, str(source), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
        digest.write_text(hashlib.sha256(tmp.read_bytes()).hexdigest())
        os.replace(tmp, out)
        os.replace(digest, _digest_path(out))
    finally:
        for f in (tmp, digest):
            with contextlib.suppress(OSError):
                f.unlink()


def _intact(so: Path) -> bool:
    """Whether ``so`` is the file a build wrote (its recorded sha256): loading a truncated shared object does not
    raise, it kills the process with SIGBUS."""
    try:
        return hashlib.sha256(so.read_bytes()).hexdigest() == _digest_path(so).read_text().strip()
    except OSError:
        return False


def _failure(e: BaseException) -> str:
    err = (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip()
    return f"{e}{': ' + err[-300:] if err else ''}"


def load_library(source: Path, cache_dir: Path) -> tuple[ctypes.CDLL | None, str]:
    """``source`` built into ``cache_dir`` (or its intact cached build) and loaded: ``(library, note)``.

    Tries an OpenMP build, then a single-threaded one. ``note`` is "" for an OpenMP build, says why the build is
    single-threaded, or, with a None library, why there is none (no compiler, a compiler that fails, an unusable
    cache folder).
    """
    cc = compiler()
    if cc is None:
        return None, "no C compiler found ($CC, cc, gcc or clang)"
    try:
        target = march()
    except ValueError as e:
        return None, str(e)
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C compiler {' '.join(cc)} does not run ({_failure(e)})"
    if target != "native" and (problem := march_problem(tuple(cc), target)):
        return None, problem
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the source may include
    key = hashlib.sha256(
        source.read_bytes() + headers + " ".join(cflags(False)).encode() + version.encode() + cpu_flags().encode()
        + platform.machine().encode()
    ).hexdigest()[:16]  # fmt: skip
    failures = []
    for openmp in (True, False):
        path = cache_dir / f"{source.stem}-{key}{'-omp' if openmp else ''}.so"
        try:
            if not _intact(path):
                if path.exists():
                    log.warning("cached kernel %s does not match its recorded sha256: rebuilding it", path)
                cache_dir.mkdir(parents=True, exist_ok=True)
                _build(cc, source, path, openmp)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as e:
            failures.append(f"{'OpenMP' if openmp else 'single-threaded'} build/load in {cache_dir}: {_failure(e)}")
            continue
        return lib, "" if openmp else f"single-threaded ({failures[0]})"
    return None, (f"LOOM_MARCH={target}: " if target != "native" else "") + "; ".join(failures)


def load_kernel(
    source: Path,
    cache_dir: Path,
    what: str,
    notes: dict[Path, str],
    functions: dict[str, list],
    unavailable: int = logging.INFO,
) -> ctypes.CDLL | None:
    """:func:`load_library` for one kernel module: each of ``functions`` (name -> argtypes) returns a C int; the
    note is kept in ``notes[cache_dir]`` and logged (a missing library at level ``unavailable``, a single-threaded
    build as a warning), naming the kernel as ``what``."""
    lib, note = load_library(source, cache_dir)
    notes[cache_dir] = note
    if lib is None:
        # a kernel asked for by name (LOOM_MARCH) that cannot be built is worth a warning, not a quiet fallback
        log.log(logging.WARNING if note.startswith("LOOM_MARCH=") else unavailable, "%s unavailable: %s", what, note)
        return None
    if note:
        log.warning("%s runs %s", what, note)
    with contextlib.suppress(ValueError):
        if march() != "native":
            log.info("%s built for -march=%s (LOOM_MARCH)", what, march())
    for name, argtypes in functions.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, ctypes.c_int
    return lib


_blocks = threading.local()


def arg_block(*vals: int) -> int:
    """The address of this thread's block of int64 arguments holding ``vals`` (at most 24): the kernels that take
    one, because separate ctypes arguments cost ~5 us per call and a new array ~2 us. Valid until the thread's next
    call."""
    block = getattr(_blocks, "block", None)
    if block is None:
        block = _blocks.block = (ctypes.c_int64 * 24)()
    block[: len(vals)] = vals
    return ctypes.addressof(block)

"""The C library's contract: it builds without a warning, refuses a caller of another interface, and its kernels
pass their tests under AddressSanitizer and UndefinedBehaviorSanitizer."""

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specviz.models import native

needs_library = pytest.mark.skipif(not native.runs_here(), reason="the library does not run here")
ROOT = Path(__file__).resolve().parents[1]
# the tests that call the library's functions themselves
KERNEL_TESTS = ("multiplies_exactly or pair_kernels or int8_kernel or rms_call or silu or c_argmax or c_topk or "
                "in_one_call or blocks_kernel or unpack")


def _compiler() -> str:
    try:
        return native._compiler()
    except RuntimeError:
        pytest.skip("no C compiler")


def test_the_library_builds_without_a_warning(tmp_path):
    out = subprocess.run([_compiler(), *native.FLAGS, "-Wextra", "-Werror", *map(str, native.SOURCES), "-o",
                          str(tmp_path / "lib.so")], capture_output=True, text=True, timeout=native.BUILD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]


@needs_library
def test_a_library_of_another_interface_is_refused(monkeypatch):
    lib = native.library()
    native.check_abi(lib)  # this one agrees
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1)
    with pytest.raises(RuntimeError, match="interface"):
        native.check_abi(lib)
    # dims of another size: the layers call returns at once, touching nothing, and says so
    dims = native.LayersDims(ctypes.sizeof(native.LayersDims) - 8, 1)
    assert lib.specviz_layers(None, ctypes.byref(dims), None, None, None, None, None, None, None, None, 1e-5, 1.0) == -1


@pytest.mark.slow
def test_the_kernels_pass_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """The kernel tests again, in a process whose library is built with -fsanitize=address,undefined (any report
    stops it); ASan's runtime comes first, with the C++ library torch's exceptions need."""
    gcc = shutil.which("gcc")
    if gcc is None or not native.runs_here():
        pytest.skip("needs gcc and a CPU the library runs on")
    runtime = [subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
               for name in ("libasan.so", "libstdc++.so.6")]
    if not all(Path(p).is_absolute() and Path(p).exists() for p in runtime):
        pytest.skip("gcc has no AddressSanitizer runtime here")
    env = {**os.environ, native.SANITIZE: "address,undefined", "SPECVIZ_CACHE": str(tmp_path / "cache"),
           "LD_PRELOAD": " ".join(runtime), "ASAN_OPTIONS": f"detect_leaks=0:log_path={tmp_path / 'report'}",
           "UBSAN_OPTIONS": f"print_stacktrace=1:log_path={tmp_path / 'report'}"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", KERNEL_TESTS,
                          "tests/test_kernels.py", "tests/test_blocks.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    reports = "".join(p.read_text() for p in tmp_path.glob("report*"))
    assert out.returncode == 0 and not reports, (reports or out.stdout)[-3000:]
    assert " passed" in out.stdout.splitlines()[-1] and " 0 passed" not in out.stdout.splitlines()[-1]

"""The skip gate of tests/conftest.py (``FLOTILLA_FAIL_ON_SKIP=1``, set by .ci/run): pytest runs
in a subprocess over a folder whose conftest is tests/conftest.py verbatim."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py").read_text()

ALLOWED = """
import pytest

@pytest.mark.skipif(True, reason="needs a GPU (none here)")
def test_gpu_mark():
    pass

def test_cuda_call():
    pytest.skip("needs a CUDA GPU")

def test_two_gpus():
    pytest.skip("needs 2 GPUs, this machine has 0")

def test_triton():
    pytest.importorskip("no_such_triton_module", reason="needs Triton (not pinned for CPU)")

def test_runs():
    pass
"""

REFUSED_TEST = """
import pytest

def test_missing_data():
    pytest.skip("the reference scenarios are not here")

def test_runs():
    pass
"""

REFUSED_MODULE = """
import pytest

pytest.importorskip("no_such_pinned_module")

def test_never_collected():
    pass
"""


@pytest.fixture
def run(pytester, monkeypatch):
    """Runs pytest over ``files`` (name -> source) with the gate on or off; returns the result."""
    pytester.makeconftest(CONFTEST)

    def run_with(files: dict[str, str], gate: bool):
        if gate:
            monkeypatch.setenv("FLOTILLA_FAIL_ON_SKIP", "1")
        else:
            monkeypatch.delenv("FLOTILLA_FAIL_ON_SKIP", raising=False)
        pytester.makepyfile(**files)
        return pytester.runpytest_subprocess("-p", "no:cacheprovider")

    return run_with


def test_skips_for_a_gpu_or_triton_pass_the_gate(run):
    result = run({"test_allowed": ALLOWED}, gate=True)
    result.assert_outcomes(passed=1, skipped=4)
    assert result.ret == pytest.ExitCode.OK
    assert "refused" not in result.stdout.str()


def test_any_other_skip_fails_the_run_and_is_listed(run):
    result = run({"test_allowed": ALLOWED, "test_refused": REFUSED_TEST, "test_module": REFUSED_MODULE}, gate=True)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*skips refused by FLOTILLA_FAIL_ON_SKIP=1*",
            "test_module.py: could not import 'no_such_pinned_module'*",
            "test_refused.py::test_missing_data: the reference scenarios are not here",
            "2 skipped for a reason that does not match*",
        ]
    )
    refused = result.stdout.str().split("skips refused by")[1].split("short test summary")[0]
    assert "test_allowed" not in refused


def test_without_the_variable_a_skip_is_only_a_skip(run):
    result = run({"test_refused": REFUSED_TEST}, gate=False)
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK

"""The one-launch greedy argmax (``kernels/triton_argmax.py``) under Triton's CPU interpreter,
against ``torch.argmax`` (exact: ``torch.equal``).

The checks are tests/gpu's (``check_argmax``, ``check_calls_in_a_row``), run with
``device="cpu"`` at vocabularies small enough for the interpreter but large enough for several
programs a row: 4096 (4 programs at B = 1), 5000 (5 at B = 2: the last program's key load
clamps past the row's keys), 40000 (2 blocks a program at B = 8). What this covers: the keys
(order-preserving float bits, NaN largest, ``-0.0`` equal to ``+0.0``, ties to the lowest
index across chunk boundaries), which program reduces (the one that brings the row's counter
to its number of programs), and the counters back at zero after every call. What it cannot:
the interpreter runs one program at a time, so the memory ordering between concurrent programs
(the barrier, the ``acq_rel`` atomic, the ``.cg`` loads) is only exercised by the CUDA runs.
Integer keys are exact in the interpreter (its bf16 rounding is in ``tl.dot``, not used here).

Run (this venv has no Triton; /tmp/tritonsite is where this machine keeps a 3.6 copy):
``PYTHONPATH=/tmp/tritonsite TRITON_INTERPRET=1 pytest tests/kernels/test_triton_argmax_interpreted.py``.
Without ``TRITON_INTERPRET=1`` (CI, or a GPU machine) this file is not collected
(tests/conftest.py): the GPU tier runs the same checks on CUDA.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)"
)
pytest.importorskip("triton", reason="needs Triton (not a CPU dependency; see the run line above)")

SIZES = ((1, 1), (3, 7), (1, 4096), (2, 5000), (8, 40000))
CASES = ("random", "chunk_ties", "all_neg_inf", "one_nan", "several_nans", "signed_zeros")


@pytest.mark.parametrize("size", SIZES, ids=[f"B{b}-V{v}" for b, v in SIZES])
@pytest.mark.parametrize("kind", CASES)
def test_greedy_argmax_equals_torch(kind, size):
    from gpu.test_triton_argmax import check_argmax

    check_argmax(kind, *size, "cpu", calls=2)


def test_three_calls_in_a_row_start_from_zeroed_counters():
    from gpu.test_triton_argmax import check_calls_in_a_row

    check_calls_in_a_row("cpu", 5000)


def test_row_views_and_a_column_major_copy():
    from gpu.test_triton_argmax import check_views

    check_views("cpu", 5000)


def test_launch_shapes_cover_the_row_with_at_most_target_programs():
    """Every size the sampler hands over (B <= MAX_ROWS, V from 1 to 262144): the programs of
    a row cover it, none starts past its end, and a call stays within the target unless its
    programs already take the most blocks (B = 8, V = 262144: 256 programs of 8 blocks)."""
    from flotilla.kernels import triton_argmax as argmax

    for rows in range(1, argmax.MAX_ROWS + 1):
        for vocab in (1, 7, 1024, 1025, 32000, 151936, 152064, 262144):
            iters, parts = argmax.launch_shape(rows, vocab)
            chunk = iters * argmax.BLOCK
            assert 1 <= iters <= argmax.MAX_ITERS
            assert (parts - 1) * chunk < vocab <= parts * chunk
            assert iters == argmax.MAX_ITERS or rows * parts <= argmax.TARGET_PROGRAMS, (rows, vocab, iters, parts)


def test_warm_up_runs_every_small_batch_and_reports_its_launch_shapes():
    """``warm_up`` launches the argmax at every batch of 1 to MAX_ROWS rows (each gets its
    scratch, which the call leaves zeroed) and returns the distinct launch shapes among them."""
    from flotilla.kernels import triton_argmax as argmax

    vocab = 5000
    shapes = argmax.warm_up(vocab, "cpu")
    sizes = range(1, argmax.MAX_ROWS + 1)
    assert sorted(shapes) == sorted({argmax.launch_shape(rows, vocab) for rows in sizes})
    for rows in sizes:
        keys, counters = argmax._SCRATCH[(torch.device("cpu"), rows, argmax.launch_shape(rows, vocab)[1])]
        assert not counters.any()

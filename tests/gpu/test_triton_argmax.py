"""The one-launch greedy argmax (``kernels/triton_argmax.py``) against ``torch.argmax``, on CUDA.

The op promises torch's indices exactly (ties to the lowest index, the first NaN, ``-0.0`` equal
to ``+0.0``, an all ``-inf`` row at 0), so every check is ``torch.equal`` with
``torch.argmax`` on the same tensor: no tolerance. The case builders and checks take a
``device``, so the same checks run under Triton's CPU interpreter (``TRITON_INTERPRET=1``,
small vocabularies; tests/kernels/test_triton_argmax_interpreted.py). The interpreter runs one
program at a time, so there they check the keys and the counting (which program reduces, the
counters back at zero); the CUDA runs below add the memory ordering between concurrent
programs, and the launch shapes actually used on a GPU (many programs a row).
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton")

ROWS = (1, 2, 3, 8)
VOCABS = (1, 7, 4096, 32000, 151936, 152064, 262144)
CASES = ("random", "chunk_ties", "all_neg_inf", "one_nan", "several_nans", "signed_zeros")
# NaNs of other bit patterns than torch's: sign bit set (below -inf as plain bits), a payload.
NANS = torch.tensor([0x7FC00000, 0xFFC00000 - 2**32, 0x7F800001, 0xFFFFFFFF - 2**32], dtype=torch.int32).view(torch.float32)


def _argmax():
    from flotilla.kernels import triton_argmax

    return triton_argmax


def chunk_starts(rows: int, vocab: int) -> list[int]:
    """The first index of every program's chunk of a row at this size (from the op's launch shape)."""
    iters, parts = _argmax().launch_shape(rows, vocab)
    return [p * iters * _argmax().BLOCK for p in range(parts)]


def argmax_case(kind: str, rows: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    """``[rows, vocab]`` float32 logits of one kind (see CASES), each row built differently:

    - ``random``: standard normal;
    - ``chunk_ties``: normal below 0, the row's maximum at several places: the last index of a
      chunk and the first of the next (so the tie crosses a program boundary), and later
      indices; row ``r`` shifts which boundary holds the first copy;
    - ``all_neg_inf``: every value ``-inf`` (torch: index 0);
    - ``one_nan`` / ``several_nans``: normal with a ``+inf``, and one NaN (or NaNs in several
      chunks; torch returns the first), of the bit patterns in NANS, the first one row-dependent;
    - ``signed_zeros``: negative values with ``-0.0`` and ``+0.0`` as the maximum, ``-0.0``
      first on even rows and ``+0.0`` first on odd rows (equal: the lower index wins).
    """
    gen = torch.Generator().manual_seed(seed * 1000 + rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=gen)
    starts = chunk_starts(rows, vocab)
    for r in range(rows):
        spots = _spread(r, vocab, starts, gen)
        if kind == "chunk_ties":
            x[r] = -x[r].abs() - 1.0
            x[r, spots] = 3.5
        elif kind == "all_neg_inf":
            x[r] = float("-inf")
        elif kind in ("one_nan", "several_nans"):
            x[r, spots[-1]] = float("inf")
            nans = spots[:1] if kind == "one_nan" else spots
            for i, spot in enumerate(nans):
                x[r, spot] = NANS[(r + i) % len(NANS)]
        elif kind == "signed_zeros":
            x[r] = -x[r].abs() - 1.0
            first, second = (-0.0, 0.0) if r % 2 == 0 else (0.0, -0.0)
            x[r, spots[0]] = first
            x[r, spots[1:]] = second
        else:
            assert kind == "random", kind
    return x.to(device)


def _spread(row: int, vocab: int, starts: list[int], gen: torch.Generator) -> list[int]:
    """Distinct ascending indices of a row: around a chunk boundary (row-dependent), then random."""
    picked = set()
    if len(starts) > 1:
        boundary = starts[1 + row % (len(starts) - 1)]
        picked |= {boundary - 1, boundary}
    picked |= {int(i) for i in torch.randint(0, vocab, (3,), generator=gen)}
    return sorted(picked)


def check_argmax(kind: str, rows: int, vocab: int, device: str, calls: int = 1) -> None:
    """``greedy_argmax`` equals ``torch.argmax`` on one case, ``calls`` times in a row (each
    call needs its row counters back at zero), and leaves those counters at zero."""
    argmax = _argmax()
    x = argmax_case(kind, rows, vocab, device)
    want = x.argmax(dim=-1)
    for call in range(calls):
        got = argmax.greedy_argmax(x)
        assert got.dtype == torch.int64 and got.device == x.device
        assert torch.equal(got, want), f"{kind} B={rows} V={vocab} call {call}: {got.tolist()} != {want.tolist()}"
    _, parts = argmax.launch_shape(rows, vocab)
    _, counters = argmax._SCRATCH[(x.device, rows, parts)]
    assert not counters.any()


def check_calls_in_a_row(device: str, vocab: int) -> None:
    """Three calls of different rows and values on the same scratch: each is right, so each
    started from zeroed counters (a stale count would make the wrong program reduce)."""
    argmax = _argmax()
    for seed in range(3):
        x = argmax_case("random", 3, vocab, device, seed=seed)
        assert torch.equal(argmax.greedy_argmax(x), x.argmax(dim=-1)), f"call {seed}"


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kind", CASES)
def test_greedy_argmax_equals_torch(kind, rows, vocab):
    check_argmax(kind, rows, vocab, "cuda")


@pytest.mark.parametrize("vocab", (4096, 151936))
def test_three_calls_in_a_row_start_from_zeroed_counters(vocab):
    check_calls_in_a_row("cuda", vocab)
    check_argmax("chunk_ties", 8, vocab, "cuda", calls=3)


def check_views(device: str, vocab: int) -> None:
    """The first rows of a larger buffer (the graph's static logits), every other row, and a
    column-major copy (``stride(1) != 1``: copied first) all give torch's indices."""
    big = argmax_case("chunk_ties", 8, vocab, device)
    for view in (big[:3], big[::2], big.t().contiguous().t()):
        assert torch.equal(_argmax().greedy_argmax(view), view.argmax(dim=-1))


def test_row_views_and_a_column_major_copy():
    check_views("cuda", 151936)


def test_bad_inputs_are_value_errors_naming_the_parameter():
    argmax = _argmax()
    with pytest.raises(ValueError, match="logits.dtype"):
        argmax.greedy_argmax(torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="logits.shape"):
        argmax.greedy_argmax(torch.zeros(8, device="cuda"))
    with pytest.raises(ValueError, match="logits.device"):
        argmax.greedy_argmax(torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r"logits.shape\[1\]"):
        argmax.greedy_argmax(torch.zeros(1, 0, device="cuda"))


@pytest.mark.parametrize("rows", (1, 3, 8, 9))
def test_sampler_greedy_tokens_are_the_same_with_the_switch_on_and_off(rows, monkeypatch):
    """The sampler's greedy path (and a mixed batch's greedy rows) gives the same tokens with
    ``triton_argmax.ENABLED`` on and off; 9 rows is above ``MAX_ROWS`` (torch either way)."""
    from flotilla.cluster.engine.sampler import Sampler, SamplingRow
    from flotilla.cluster.engine.sampling_params import SamplingParams

    argmax = _argmax()
    # NOTE: the mixed batch gets distinct values: top_k=1 keeps every copy of a tied maximum.
    tied = argmax_case("chunk_ties", rows, 151936, "cuda", seed=5)
    distinct = argmax_case("random", rows, 151936, "cuda", seed=5)
    greedy = [SamplingRow(SamplingParams(temperature=0)) for _ in range(rows)]
    mixed = [SamplingRow(SamplingParams(temperature=0) if r % 2 == 0 else SamplingParams(top_k=1)) for r in range(rows)]
    scratch = (tied.device, rows, argmax.launch_shape(rows, 151936)[1])
    tokens = {}
    for enabled in (True, False):
        monkeypatch.setattr(argmax, "ENABLED", enabled)
        argmax._SCRATCH.pop(scratch, None)
        tokens[enabled] = [[t.token_id for t in Sampler()(x, batch)] for x, batch in ((tied, greedy), (distinct, mixed))]
        # NOTE: the kernel ran iff its scratch was made again: on, and at most MAX_ROWS rows.
        assert (scratch in argmax._SCRATCH) == (enabled and rows <= argmax.MAX_ROWS)
    want = [tied.argmax(dim=-1).tolist(), distinct.argmax(dim=-1).tolist()]  # top_k=1 keeps only the argmax
    assert tokens[True] == tokens[False] == want


def _compiled_variants(kernel) -> int:
    """How many compiled variants Triton holds for ``kernel`` (all devices)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def test_sampler_warm_up_leaves_no_batch_size_to_compile_while_serving():
    """After the sampler's warm-up, greedy steps of every batch the Triton argmax takes (1 to
    MAX_ROWS rows) compile nothing and allocate no scratch: each batch size's compile-time
    constants were compiled at start. An odd vocabulary (a specialisation no other test here
    uses) so the variants cannot come from an earlier test."""
    from flotilla.cluster.engine.sampler import Sampler, SamplingRow
    from flotilla.cluster.engine.sampling_params import SamplingParams

    argmax = _argmax()
    vocab = 128257
    shapes = Sampler().warm_up(vocab, torch.device("cuda"))
    sizes = range(1, argmax.MAX_ROWS + 1)
    assert sorted(shapes) == sorted({argmax.launch_shape(rows, vocab) for rows in sizes})
    assert len(shapes) > 1  # NOTE: the constants do change with the batch (why a warm-up is needed)
    compiled, scratch = _compiled_variants(argmax._argmax_kernel), set(argmax._SCRATCH)
    for rows in sizes:
        logits = argmax_case("random", rows, vocab, "cuda", seed=rows)
        tokens = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0)) for _ in range(rows)])
        assert [t.token_id for t in tokens] == logits.argmax(dim=-1).tolist()
    assert _compiled_variants(argmax._argmax_kernel) == compiled
    assert set(argmax._SCRATCH) == scratch

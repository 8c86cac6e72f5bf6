"""The attention-planning helpers that run on CPU: the CSR page layout built from the
runner's lists, its padding to a CUDA-graph batch, its split into leading decodes and the
rest, and the torch backend's no-op planner."""

import pytest
import torch

from flotilla.kernels.attention import AttentionMetadata, AttentionShape, page_layout, step_layout
from flotilla.kernels.registry import get

BLOCK = 4


def _meta(seq_lens, query_lens, tables, with_layout=True):
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(query_start[-1], dtype=torch.long),
        query_start=torch.tensor(query_start),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK,
    )
    if with_layout:
        meta.page_indptr, meta.page_indices, meta.last_page_len = page_layout(seq_lens, tables, BLOCK)
        meta.query_start_cpu = torch.tensor(query_start, dtype=torch.int32)
        meta.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    return meta


def test_page_layout_is_the_csr_form_of_the_block_tables():
    # lengths 1 (one partial block), 4 (one full block), 9 (two full + one token); a table
    # longer than the sequence needs (padding) contributes only its live blocks.
    indptr, indices, last = page_layout([1, 4, 9], [[7], [3, 0], [5, 2, 8]], BLOCK)
    assert indptr.tolist() == [0, 1, 2, 5]
    assert indices.tolist() == [7, 3, 5, 2, 8]
    assert last.tolist() == [1, 4, 1]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}


def test_page_layout_rejects_a_short_block_table():
    with pytest.raises(ValueError, match="needs 3 blocks"):
        page_layout([9], [[1, 2]], BLOCK)


def test_step_layout_pads_a_decode_batch_to_the_graph_size():
    meta = _meta([5, 2], [1, 1], [[4, 6], [9]])
    layout = step_layout(meta, pad_to=4, padding_page=0)
    assert layout.num_seqs == 4 and layout.num_tokens == 4
    assert layout.query_start.tolist() == [0, 1, 2, 3, 4]
    assert layout.page_indptr.tolist() == [0, 2, 3, 4, 5]
    assert layout.page_indices.tolist() == [4, 6, 9, 0, 0]
    assert layout.last_page_len.tolist() == [1, 2, 1, 1]
    assert layout.seq_lens.tolist() == [5, 2, 1, 1]
    assert step_layout(meta, pad_to=2).page_indices.tolist() == [4, 6, 9]


def test_step_layout_splits_its_leading_decodes_from_the_rest():
    # two decodes (contexts 5 and 2), a 3-token chunk after 6 cached tokens, a trailing decode
    meta = _meta([5, 2, 9, 3], [1, 1, 3, 1], [[4, 6], [9], [1, 2, 3], [7]])
    layout = step_layout(meta)
    assert layout.num_leading_decodes() == 2
    decodes, rest = layout.split(2)
    assert decodes.query_start.tolist() == [0, 1, 2] and rest.query_start.tolist() == [0, 3, 4]
    assert decodes.page_indptr.tolist() == [0, 2, 3] and rest.page_indptr.tolist() == [0, 3, 4]
    assert decodes.page_indices.tolist() == [4, 6, 9] and rest.page_indices.tolist() == [1, 2, 3, 7]
    assert decodes.last_page_len.tolist() == [1, 2] and rest.last_page_len.tolist() == [1, 3]
    assert decodes.seq_lens.tolist() == [5, 2] and rest.seq_lens.tolist() == [9, 3]
    assert step_layout(_meta([5, 9], [2, 1], [[4, 6], [1, 2, 3]])).num_leading_decodes() == 0
    assert step_layout(_meta([5, 2], [1, 1], [[4, 6], [9]])).num_leading_decodes() == 2
    for bad in (0, 4):
        with pytest.raises(ValueError, match=f"num_seqs={bad}"):
            layout.split(bad)


def test_step_layout_errors_name_the_problem():
    with pytest.raises(ValueError, match="missing"):
        step_layout(_meta([5], [1], [[4, 6]], with_layout=False))
    with pytest.raises(ValueError, match="does not fit graph_batch_size=1"):
        step_layout(_meta([5, 2], [1, 1], [[4, 6], [9]]), pad_to=1)


def test_torch_planner_is_a_no_op():
    shape = AttentionShape(4, 2, 16, 16, 0.25, None, torch.float32)
    planner = get("attention_planner", "torch")(shape, "cpu", block_size=BLOCK, max_num_seqs=8, max_num_pages=64)
    meta = _meta([5, 3], [2, 3], [[1, 2], [3]])
    meta.plan = "stale"
    planner.plan(meta)
    assert meta.plan is None
    planner.plan(meta, graph_batch_size=None)
    assert meta.plan is None


def test_metadata_built_without_the_new_fields_keeps_working():
    meta = _meta([5], [1], [[4, 6]], with_layout=False)
    assert meta.plan is None and meta.page_indptr is None and meta.is_decode

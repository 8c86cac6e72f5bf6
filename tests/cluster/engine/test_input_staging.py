"""``InputStaging`` (a step's lists to its device tensors, one copy) and the decode-graph
input block it lays out for ``CudaGraphs.run``: on CPU, where the staging buffer is a numpy
array and the tensors are views of it, as the device buffer's views are on CUDA."""

import torch

from flotilla.cluster.engine.cuda_graphs import _row_block
from flotilla.cluster.engine.input_staging import InputStaging


def _build(input_ids, positions, slots, query_start, seq_lens, pages, page_indptr, last_page_len, max_query_len):
    return InputStaging(torch.device("cpu")).build(
        input_ids, positions, slots, query_start, seq_lens, list(range(len(seq_lens))),
        pages, page_indptr, last_page_len, block_size=4, max_query_len=max_query_len,
    )  # fmt: skip


def test_a_decode_step_stages_its_graph_inputs_as_one_block():
    ids, pos, meta, sample = _build(
        [11, 12, 13], [5, 8, 2], [21, 34, 10], [0, 1, 2, 3], [6, 9, 3], [5, 8, 8, 2], [0, 1, 3, 4], [2, 1, 3], 1
    )
    assert ids.tolist() == [11, 12, 13] and pos.tolist() == [5, 8, 2]
    assert meta.slot_mapping.tolist() == [21, 34, 10] and meta.seq_lens.tolist() == [6, 9, 3]
    assert meta.query_start.tolist() == [0, 1, 2, 3] and sample.tolist() == [0, 1, 2]
    assert meta.block_tables.tolist() == [[5, 0], [8, 8], [2, 0]]
    block = _row_block(ids, pos, meta.slot_mapping, meta.seq_lens)
    assert block is not None
    assert block.tolist() == [[11, 12, 13], [5, 8, 2], [21, 34, 10], [6, 9, 3]]


def test_rows_that_are_not_back_to_back_are_no_block():
    ids, pos, meta, _ = _build([7, 8, 9, 10], [0, 1, 2, 0], [0, 1, 2, 4], [0, 3, 4], [3, 1], [0, 1], [0, 1, 2], [3, 1], 3)
    # a prefill step: 4 tokens, 2 sequences
    assert _row_block(ids, pos, meta.slot_mapping, meta.seq_lens) is None
    assert _row_block(ids, pos, meta.slot_mapping) is not None
    assert _row_block(pos, ids, meta.slot_mapping) is None  # out of order
    separate = [torch.tensor([1, 2]), torch.tensor([3, 4])]
    assert _row_block(*separate) is None
    assert _row_block(torch.arange(4)[:2], torch.arange(4)[2:].int()) is None  # another dtype

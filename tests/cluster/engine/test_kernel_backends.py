"""The runner's start-up choices on a CPU box: which kernel backend each op family runs on
(``kernel_backends_for``), which decode batch sizes get CUDA graphs
(``decode_graph_sizes``), and the step input layout the attention planners read
(``prepare_inputs``'s CPU page layout, and its padding to a graph batch).

Library availability is a predicate argument, so the CUDA mapping is checked here without
CUDA; the one test of the real check uses this box, where flashinfer is not installed.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from flotilla.cluster.engine.cuda_graphs import DecodeGraphs, decode_graph_sizes, uncapturable_collectives
from flotilla.cluster.engine.kernel_backends import (
    KernelBackends,
    has_experts,
    kernel_backends_for,
    library_installed,
    load_kernel_backends,
)
from flotilla.cluster.engine.model_runner import ModelRunner
from flotilla.cluster.engine.request import Request
from flotilla.cluster.engine.scheduler import ScheduledRequest, SchedulerOutput
from flotilla.cluster.models.base import ParallelLayout
from flotilla.cluster.models.sources import resolve_model_source
from flotilla.kernels import registry
from flotilla.kernels.attention import page_layout, step_layout
from flotilla.resolution import ModelFacts, ServerArgs, preset, resolve
from helpers.scenarios import SCENARIO_DIR, scenario_files


def everything(_module: str) -> bool:
    return True


def config(**fields):
    base = dict(
        device="cuda",
        dtype="bfloat16",
        attention_backend="fa3",
        prefill_attention_backend=None,
        decode_attention_backend=None,
        sampling_backend="flashinfer",
        moe_runner_backend="auto",
    )
    return SimpleNamespace(**{**base, **fields})


# -- kernel_backends_for -------------------------------------------------------------

CUDA_NAMES = ("fa3", "fa4", "flashinfer", "triton", "trtllm_mha", "trtllm_mla", "flashmla", "cutlass_mla")


@pytest.mark.parametrize("name", CUDA_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_names_run_on_flashinfer_in_half_precision(name, dtype):
    chosen = kernel_backends_for(config(attention_backend=name), dtype, available=everything)
    assert chosen.as_dict() == {
        "attention": "flashinfer",
        "elementwise": "flashinfer",
        "moe": "triton",
        "linear": "triton",
        "fp8": "torch",
        "sampling": "flashinfer",
    }
    assert chosen.chosen_by["attention"] == f"attention_backend={name!r}"


@pytest.mark.parametrize("name", ["torch_native", "flex_attention"])
def test_torch_attention_names_run_the_reference_on_cuda(name):
    chosen = kernel_backends_for(config(attention_backend=name), torch.bfloat16, available=everything)
    assert (chosen.attention, chosen.elementwise, chosen.linear, chosen.sampling) == ("torch", "torch", "torch", "flashinfer")


def test_float32_runs_the_torch_references_on_cuda():
    """flashinfer has no float32 attention; float32 is the exactness path: every family torch."""
    chosen = kernel_backends_for(config(attention_backend="fa3"), torch.float32, available=everything)
    assert chosen == KernelBackends()


def test_dtype_is_read_from_the_config_when_not_given():
    assert kernel_backends_for(config(dtype="float16"), available=everything).attention == "flashinfer"
    # NOTE: auto without the loaded dtype counts as float32 (the references).
    assert kernel_backends_for(config(dtype="auto"), available=everything) == KernelBackends()


@pytest.mark.parametrize("name", ["fa3", "flashinfer", "torch_native", "trtllm_mla"])
def test_cpu_always_runs_the_torch_references(name):
    chosen = kernel_backends_for(config(device="cpu", attention_backend=name), torch.bfloat16, available=everything)
    assert chosen == KernelBackends()


def test_sampling_pytorch_and_dense_models_keep_torch():
    chosen = kernel_backends_for(config(sampling_backend="pytorch"), torch.bfloat16, moe_model=False, available=everything)
    assert (chosen.sampling, chosen.moe) == ("torch", "torch")


def test_split_prefill_decode_fields_map_to_one_backend():
    split = config(attention_backend="flashinfer", prefill_attention_backend="trtllm_mla", decode_attention_backend="cutedsl_mla")
    assert kernel_backends_for(split, torch.bfloat16, available=everything).attention == "flashinfer"
    mixed = config(prefill_attention_backend="torch_native", decode_attention_backend="fa3")
    with pytest.raises(ValueError, match="one attention backend for prefill and decode"):
        kernel_backends_for(mixed, torch.bfloat16, available=everything)


def test_a_backend_for_other_hardware_is_refused_on_cuda():
    with pytest.raises(ValueError, match=r"attention_backend='ascend' is not a CUDA attention backend"):
        kernel_backends_for(config(attention_backend="ascend"), torch.bfloat16, available=everything)


def test_a_missing_library_names_the_field_the_value_and_the_fix():
    missing_flashinfer = lambda module: module != "flashinfer"  # noqa: E731
    with pytest.raises(ValueError) as err:
        kernel_backends_for(config(attention_backend="fa3"), torch.bfloat16, available=missing_flashinfer)
    message = str(err.value)
    assert "attention_backend='fa3' needs flashinfer" in message
    assert "pip install" in message and "flashinfer-python==0.7.2.post1" in message
    assert "--attention-backend torch_native" in message
    # The reference attention still needs flashinfer for sampling unless asked otherwise.
    with pytest.raises(ValueError, match=r"sampling_backend='flashinfer' needs flashinfer.*--sampling-backend pytorch"):
        kernel_backends_for(config(attention_backend="torch_native"), torch.bfloat16, available=missing_flashinfer)
    reference = config(attention_backend="torch_native", sampling_backend="pytorch")
    chosen = kernel_backends_for(reference, torch.bfloat16, moe_model=False, available=missing_flashinfer)
    assert chosen == KernelBackends()


def test_a_missing_triton_fails_only_moe_models():
    no_triton = lambda module: module != "triton"  # noqa: E731
    with pytest.raises(ValueError, match=r"moe_runner_backend='auto' needs triton"):
        kernel_backends_for(config(), torch.bfloat16, available=no_triton)
    dense = kernel_backends_for(config(), torch.bfloat16, moe_model=False, available=no_triton)
    # NOTE: the Triton decode GEMV is an optimization no flag asks for: without triton it is F.linear.
    assert (dense.moe, dense.linear, dense.attention) == ("torch", "torch", "flashinfer")


def test_fp8_checkpoints_run_their_fp8_layers_on_triton_in_half_precision():
    chosen = kernel_backends_for(config(), torch.bfloat16, fp8_model=True, available=everything)
    assert (chosen.fp8, chosen.moe) == ("triton", "triton")
    assert kernel_backends_for(config(), torch.float32, fp8_model=True, available=everything).fp8 == "torch"
    assert kernel_backends_for(config(device="cpu"), torch.bfloat16, fp8_model=True, available=everything).fp8 == "torch"
    no_triton = lambda module: module != "triton"  # noqa: E731
    with pytest.raises(ValueError, match=r"quant_method='fp8' needs triton.*--dtype float32 \(the torch FP8 reference\)"):
        kernel_backends_for(config(), torch.bfloat16, moe_model=False, fp8_model=True, available=no_triton)


def _smollm2_config(platform: str, **flags):
    source = resolve_model_source(None)
    args = ServerArgs.create(model_path=str(source.path), **flags)
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), preset(platform))


def test_this_box_cannot_build_a_cuda_runner_and_says_why():
    """The real library check: flashinfer is not installed on the CPU test machines, so an H200
    config in bf16 fails at start with the field, the value and the pip line."""
    if library_installed("flashinfer"):
        pytest.skip("flashinfer is installed here")
    resolved = _smollm2_config("h200", dtype="bfloat16")
    assert resolved.attention_backend == "fa3"
    with pytest.raises(ValueError, match=r"attention_backend='fa3' needs flashinfer, which is not installed"):
        kernel_backends_for(resolved, torch.bfloat16, moe_model=False)


def test_load_kernel_backends_turns_a_registry_failure_into_a_start_error():
    if library_installed("flashinfer"):
        pytest.skip("flashinfer is installed here")
    chosen = KernelBackends(
        attention="flashinfer", elementwise="flashinfer", sampling="flashinfer",
        chosen_by={"attention": "attention_backend='fa3'"},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"attention_backend='fa3' selects the 'flashinfer' attention kernels, which failed"):
        load_kernel_backends(chosen, registry)
    load_kernel_backends(KernelBackends(), registry)  # the references always load


def test_every_reference_scenario_maps_to_a_backend():
    """Each attention backend resolution produced in the reference scenarios maps (on CUDA in
    bf16) to flashinfer, or to torch on the CPU preset."""
    files = scenario_files()
    assert files, f"no scenario files under {SCENARIO_DIR}; set FLOTILLA_SHARED"
    seen = 0
    for path in files:
        scenario = json.loads(path.read_text())
        expect = scenario.get("expect") or {}
        if not expect.get("attention_backend"):
            continue
        device = "cpu" if scenario["platform"] == "cpu" else "cuda"
        fields = {k: expect.get(k) for k in ("attention_backend", "prefill_attention_backend", "decode_attention_backend")}
        chosen = kernel_backends_for(
            config(device=device, sampling_backend=expect.get("sampling_backend"), **fields),
            torch.bfloat16,
            moe_model=has_experts(scenario["hf_config"]),
            available=everything,
        )
        assert chosen.attention == ("torch" if device == "cpu" else "flashinfer"), (path.name, fields)
        seen += 1
    assert seen > 10


# -- decode_graph_sizes -------------------------------------------------------------

CUDA = torch.device("cuda")


def graph_sizes(resolved, **overrides):
    options = dict(
        device=CUDA,
        attention_backend="flashinfer",
        collectives=None,
        elastic=False,
        recording=False,
        moe_on_torch=False,
        max_num_seqs=256,
    )
    return decode_graph_sizes(resolved, **{**options, **overrides})


def test_graph_sizes_follow_resolution_capped_at_the_running_requests():
    sizes, reason = graph_sizes(_smollm2_config("h200"))
    assert reason is None and sizes[:5] == (1, 2, 4, 8, 12) and sizes[-1] == 256
    assert graph_sizes(_smollm2_config("h200", cuda_graph_max_bs_decode=8))[0] == (1, 2, 4, 8)
    # A cap between two sizes is itself captured, so every batch up to it replays.
    assert graph_sizes(_smollm2_config("h200"), max_num_seqs=3)[0] == (1, 2, 3)
    assert graph_sizes(_smollm2_config("h200", cuda_graph_bs_decode=[1, 3, 5]))[0] == (1, 3, 5)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(device=torch.device("cpu")), "not CUDA"),
        (dict(attention_backend="torch"), "torch attention reference"),
        (dict(collectives="gloo"), "collectives cannot be captured: gloo"),
        (dict(elastic=True), "elastic EP"),
        (dict(recording=True), "expert-load recorder"),
        (dict(moe_on_torch=True), "torch MoE reference"),
    ],
)
def test_graphs_are_off_with_a_reason(overrides, reason):
    sizes, why = graph_sizes(_smollm2_config("h200"), **overrides)
    assert sizes == () and reason in why


def test_disable_cuda_graph_turns_decode_graphs_off():
    sizes, why = graph_sizes(_smollm2_config("h200", disable_cuda_graph=True))
    assert sizes == () and "disabled by the configuration" in why


class _Comm:
    """A stand-in with a Communicator's two attributes the capture check reads."""

    def __init__(self, size: int, on_device: bool):
        self.size, self.on_device = size, on_device


def _layout(on_device: bool = True, **sizes) -> ParallelLayout:
    world = max(sizes.get(k, 1) for k in ("tp_size", "ep_size", "dp_size", "dcp_size", "moe_tp_size"))
    return ParallelLayout(**sizes, comms={"tp": _Comm(world, on_device), "attn_tp": _Comm(world, on_device)})


@pytest.mark.parametrize(
    "layout, reason",
    [
        (ParallelLayout(), None),
        (_layout(tp_size=2), None),
        (_layout(tp_size=2, ep_size=2, moe_a2a_backend="none"), None),
        (_layout(tp_size=2, moe_tp_size=2), None),
        (_layout(False, tp_size=2), "gloo"),
        (_layout(tp_size=1, dp_size=2, ep_size=2), "DP attention (dp_size=2)"),
        (_layout(tp_size=2, dcp_size=2), "dcp_size=2"),
        (_layout(tp_size=2, ep_size=2, moe_a2a_backend="deepep"), "moe_a2a_backend='deepep'"),
    ],
)
def test_which_collectives_a_decode_graph_can_hold(layout, reason):
    why = uncapturable_collectives(layout)
    assert why == reason if reason is None else reason in why


# -- the step input layout ------------------------------------------------------------

BLOCK = 4


@pytest.fixture(scope="module")
def cpu_runner(tiny_llama_prompts):
    path, _ = tiny_llama_prompts
    source = resolve_model_source(path)
    args = ServerArgs.create(model_path=path, max_total_tokens=256, page_size=BLOCK)
    resolved = resolve(args, ModelFacts.from_hf_config(source.config_dict), preset("cpu"))
    runner = ModelRunner(resolved, source)
    assert runner.kv_layout.block_size == BLOCK and runner.graphs is None
    return runner


def scheduled(prompt_len: int, start: int, count: int, blocks: list[int], outputs: int = 0) -> ScheduledRequest:
    request = Request(f"r{prompt_len}-{start}", list(range(1, prompt_len + 1)), max_tokens=8)
    for token in range(outputs):
        request.append_output_token(100 + token)
    request.block_ids = list(blocks)
    return ScheduledRequest(request, count, start)


def mixed_step() -> SchedulerOutput:
    """A prefill chunk starting mid-block, two decodes (one on a block boundary) and a
    one-token prefill."""
    items = [
        scheduled(11, 2, 7, [5, 9, 3]),  # tokens 2..8 of 11: a partial chunk, no sample
        scheduled(6, 6, 1, [7, 1], outputs=1),  # decode at position 6
        scheduled(8, 8, 1, [2, 4, 6], outputs=1),  # decode starting block 2
        scheduled(1, 0, 1, [8]),  # a one-token prompt
    ]
    return SchedulerOutput(items, [], sum(i.num_new_tokens for i in items))


def test_prepare_inputs_lays_out_tokens_slots_and_the_cpu_page_layout(cpu_runner):
    step = mixed_step()
    input_ids, positions, meta, sample_index = cpu_runner.prepare_inputs(step)
    expect_ids, expect_pos, expect_slots, tables, seq_lens = [], [], [], [], []
    for item in step.scheduled:
        start, end, blocks = item.start_position, item.start_position + item.num_new_tokens, item.request.block_ids
        expect_ids += item.request.all_token_ids[start:end]
        expect_pos += list(range(start, end))
        expect_slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
        tables.append(blocks[: -(-end // BLOCK)])
        seq_lens.append(end)
    assert input_ids.tolist() == expect_ids and positions.tolist() == expect_pos
    assert meta.slot_mapping.tolist() == expect_slots
    assert meta.query_start.tolist() == [0, 7, 8, 9, 10] and meta.seq_lens.tolist() == seq_lens
    assert meta.block_tables.tolist() == [t + [0] * (3 - len(t)) for t in tables]
    assert (meta.max_query_len, meta.max_seq_len, meta.block_size) == (7, 9, BLOCK)
    assert sample_index.tolist() == [7, 8, 9]  # the partial chunk samples nothing
    indptr, indices, last = page_layout(seq_lens, tables, BLOCK)
    assert meta.page_indptr.tolist() == indptr.tolist() == [0, 3, 5, 8, 9]
    assert meta.page_indices.tolist() == indices.tolist()
    assert meta.last_page_len.tolist() == last.tolist() == [1, 3, 1, 1]
    assert meta.query_start_cpu.tolist() == [0, 7, 8, 9, 10] and meta.seq_lens_cpu.tolist() == seq_lens
    for name in ("page_indptr", "page_indices", "last_page_len", "query_start_cpu", "seq_lens_cpu"):
        field = getattr(meta, name)
        assert field.dtype == torch.int32 and field.device.type == "cpu", name


def test_prepare_inputs_of_a_pure_decode_step(cpu_runner):
    step = SchedulerOutput([scheduled(6, 6, 1, [7, 1], outputs=1), scheduled(3, 3, 1, [2], outputs=1)], [], 2)
    _, positions, meta, sample_index = cpu_runner.prepare_inputs(step)
    assert meta.is_decode and positions.tolist() == [6, 3] and sample_index.tolist() == [0, 1]
    assert meta.block_tables.tolist() == [[7, 1], [2, 0]] and meta.last_page_len.tolist() == [3, 4]


def test_graph_padding_matches_the_planner_padding(cpu_runner):
    """The CPU page layout a decode graph plans is the planner's own padding of the step:
    each padding row one token in the scratch block."""
    decodes = [scheduled(6, 6, 1, [7, 1], outputs=1), scheduled(9, 9, 1, [2, 4, 6], outputs=1), scheduled(2, 2, 1, [5], outputs=1)]
    _, _, meta, _ = cpu_runner.prepare_inputs(SchedulerOutput(decodes, [], 3))
    scratch = 63
    graphs = DecodeGraphs(
        lambda *args: None,
        None,
        batch_sizes=(1, 2, 4, 8),
        device=torch.device("cpu"),
        block_size=BLOCK,
        scratch_block=scratch,
        max_seq_len=256,
    )
    assert [graphs.padded_size(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [None, 1, 4, 4, 8, 8, None]
    for bs in (4, 8):
        padded = graphs.padded_meta(meta, bs)
        ours = step_layout(padded)
        planner_padding = step_layout(meta, pad_to=bs, padding_page=scratch)
        for name in ("query_start", "page_indptr", "page_indices", "last_page_len", "seq_lens"):
            assert getattr(ours, name).tolist() == getattr(planner_padding, name).tolist(), (bs, name)
        assert padded.num_seqs == bs and padded.is_decode
        assert padded.block_tables.tolist() == [[scratch]] * bs

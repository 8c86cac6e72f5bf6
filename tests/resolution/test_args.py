"""SGLang-spelled flags parse into ServerArgs; explicit fields are remembered."""

import pytest

from flotilla.resolution import ArgumentError, ServerArgs
from flotilla.resolution.fields import DEFAULTS, FIELDS, RESOLVABLE


def test_sglang_aliases_and_deprecated_spellings():
    args = ServerArgs.from_cli(
        ["--tensor-parallel-size", "4", "--dp", "2", "--ep", "4", "--enable-nsa-prefill-context-parallel",
         "--nsa-prefill-backend", "flashmla_kv", "--cuda-graph-max-bs", "64", "--disable-cuda-graph"]
    )
    assert (args.tp_size, args.dp_size, args.ep_size) == (4, 2, 4)
    assert args.enable_dsa_prefill_context_parallel is True
    assert args.dsa_prefill_backend == "flashmla_kv"
    assert args.cuda_graph_max_bs_decode == 64
    assert args.disable_cuda_graph is True
    assert args.explicit >= {"tp_size", "dp_size", "ep_size", "dsa_prefill_backend"}
    assert "page_size" not in args.explicit and args.page_size is None


def test_value_kinds():
    args = ServerArgs.from_cli(
        ["--max-total-tokens", "32k", "--dcp-replicate-q-proj", "--cuda-graph-bs", "1", "2",
         "--json-model-override-args", '{"a": 1}', "--mem-fraction-static", "0.5"]
    )
    assert args.max_total_tokens == 32000
    assert args.dcp_replicate_q_proj is True
    assert args.cuda_graph_bs_decode == [1, 2]
    assert args.mem_fraction_static == 0.5
    assert ServerArgs.from_cli(["--no-dcp-replicate-q-proj"]).dcp_replicate_q_proj is False


def test_unknown_flag_names_the_closest_valid_one():
    with pytest.raises(ArgumentError, match=r"unrecognized flag --tp-szie; did you mean --tp-size\?"):
        ServerArgs.from_cli(["--tp-szie", "2"])


def test_bad_choice_lists_the_choices():
    with pytest.raises(ArgumentError, match=r"invalid choice: 'warp'.*'deepep'"):
        ServerArgs.from_cli(["--moe-a2a-backend", "warp"])


def test_bad_number_names_the_flag():
    with pytest.raises(ArgumentError, match="--tp-size"):
        ServerArgs.from_cli(["--tp", "two"])


def test_create_checks_names_and_choices():
    assert ServerArgs.create(tp_size=2).explicit == {"tp_size"}
    with pytest.raises(ArgumentError, match="did you mean tp_size"):
        ServerArgs.create(tp_sise=2)
    with pytest.raises(ArgumentError, match="invalid value for moe_a2a_backend"):
        ServerArgs.create(moe_a2a_backend="warp")


def test_field_table_is_complete_and_documented():
    assert len(FIELDS) >= 480
    assert {"ep_size", "attention_backend", "moe_runner_backend", "page_size"} <= RESOLVABLE
    assert "tp_size" not in RESOLVABLE
    for name, spec in FIELDS.items():
        assert spec.help and len(spec.help) < 200, name
        assert spec.default == DEFAULTS[name]
        if spec.kind == "bool" and spec.cli:
            assert spec.default in (False, None, True), name

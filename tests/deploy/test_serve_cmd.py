"""``flotilla serve``'s flags for prefill/decode disaggregation: parsing, the refusals (exit
status 2, a message naming the flag and value, nothing started), and the two configs PD
resolves (one per role). No Ray here: every case is decided before Ray is touched."""

import pytest

from flotilla.deploy.serve_cmd import parse_serve_args, resolve_serving, run_serve, split_pd_mode
from flotilla.resolution import ArgumentError
from flotilla.serve.pd import check_pd_options, pd_server_fields


def test_pd_mode_is_taken_out_of_the_server_flags():
    assert split_pd_mode(["--disaggregation-mode", "pd", "--port", "1"]) == (["--port", "1"], True)
    assert split_pd_mode(["--disaggregation-mode=null"]) == ([], False)
    assert split_pd_mode(["--port", "1"]) == (["--port", "1"], False)


def test_pd_flags_parse():
    opts, given = parse_serve_args(
        ["--disaggregation-mode", "pd", "--prefill-replicas", "2", "--decode-replicas", "3", "--prefill-tp", "2",
         "--kv-transport", "ray", "--kv-load-failure-policy", "fail", "--max-total-tokens", "2048"]
    )  # fmt: skip
    assert opts.pd and (opts.prefill_replicas, opts.decode_replicas, opts.prefill_tp, opts.decode_tp) == (2, 3, 2, None)
    assert (opts.kv_transport, opts.kv_load_failure_policy) == ("ray", "fail")
    assert given == {"max_total_tokens": 2048}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--disaggregation-mode", "prefill"], ["--disaggregation-mode prefill", "pd"]),
        (["--disaggregation-mode"], ["--disaggregation-mode", "value"]),
        (["--prefill-replicas", "2"], ["--prefill-replicas 2", "--disaggregation-mode pd"]),
        (["--disaggregation-mode", "pd", "--decode-tp", "0"], ["--decode-tp", "0"]),
        (["--disaggregation-mode", "pd", "--num-replicas", "2"], ["--num-replicas", "--prefill-replicas"]),
    ],
)
def test_bad_pd_flags_are_refused(argv, words):
    with pytest.raises(ArgumentError) as err:
        parse_serve_args(argv)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_run_serve_exits_2_on_a_bad_pd_flag(capsys):
    assert run_serve(["--disaggregation-mode", "decode"]) == 2
    assert "--disaggregation-mode decode" in capsys.readouterr().err


def test_each_pool_resolves_for_its_role():
    opts, given = parse_serve_args(
        ["--disaggregation-mode", "pd", "--prefill-tp", "3", "--decode-tp", "1", "--max-total-tokens", "2048"]
    )
    prefill, decode, options = resolve_serving(opts, given)
    assert (prefill.disaggregation_mode, prefill.tp_size) == ("prefill", 3)
    assert (decode.disaggregation_mode, decode.tp_size) == ("decode", 1)
    assert prefill.disaggregation_transfer_backend == decode.disaggregation_transfer_backend == "nixl"
    assert decode.disable_radix_cache is False  # NOTE: the decode pool keeps its prefix cache
    assert (options.disaggregation_mode, options.prefill_replicas, options.decode_replicas) == ("pd", 1, 1)
    assert options.kv_transport in ("nixl", "ray")
    check_pd_options(prefill, decode, options)  # a valid setup passes


def test_a_transfer_backend_flotilla_lacks_is_refused():
    with pytest.raises(ValueError, match="--disaggregation-transfer-backend mooncake"):
        pd_server_fields({"disaggregation_transfer_backend": "mooncake"})
    with pytest.raises(ValueError, match="--prefill-tp must be an integer >= 1"):
        pd_server_fields({}, prefill_tp=0)


def test_pools_that_disagree_on_the_kv_layout_are_refused():
    opts, given = parse_serve_args(["--disaggregation-mode", "pd", "--max-total-tokens", "2048"])
    prefill, decode, options = resolve_serving(opts, given)
    _, decode_16 = pd_server_fields({"max_total_tokens": 2048, "page_size": 32})
    from flotilla.cluster.platform import probe
    from flotilla.serve.app import resolve_for_serving

    other, _ = resolve_for_serving(decode_16, probe())
    with pytest.raises(ValueError, match="page_size"):
        check_pd_options(prefill, other, options)
    import dataclasses

    with pytest.raises(ValueError, match="--decode-replicas must be an integer >= 1"):
        check_pd_options(prefill, decode, dataclasses.replace(options, decode_replicas=0))
    with pytest.raises(ValueError, match="--kv-transport"):
        check_pd_options(prefill, decode, dataclasses.replace(options, kv_transport="tcp"))

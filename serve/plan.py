"""The serving plan: flags, the model and the platform turned into what a deployment runs
with, once, in the driver (``flotilla serve``, ``serve run ...:build``, the benchmarks).

This module grows the :class:`ServePlan`; today it holds the PD pools' planning: each pool's
server fields (:func:`pd_server_fields`), where a replica's ranks run (:func:`ranks_in_replica`)
and the checks across the two pools (:func:`check_pd_options`).
"""

from __future__ import annotations

from typing import Any, Mapping

from flotilla.serve.types import ServeOptions


def pd_server_fields(
    given: Mapping[str, Any], prefill_tp: int | None = None, decode_tp: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The server fields each pool resolves from: the user's (``given``, from the
    flags) with ``disaggregation_mode`` set to the pool's role and ``tp_size`` to
    ``--prefill-tp`` / ``--decode-tp`` when given (else the shared ``--tp-size``).

    Choices made here (each overridable by giving the flag): the transfer backend reads
    ``nixl`` (what moves the KV; flotilla has no mooncake), and the decode pool keeps its
    prefix cache (``--disaggregation-decode-enable-radix-cache``; SGLang's decode servers
    default to no radix cache), so prompts sharing a prefix skip those blocks' transfer.

    Raises ValueError naming the flag for a transfer backend flotilla does not have.
    """
    base = {k: v for k, v in given.items() if k != "disaggregation_mode"}
    backend = base.get("disaggregation_transfer_backend")
    if backend not in (None, "nixl"):
        raise ValueError(
            f"--disaggregation-transfer-backend {backend}: flotilla moves KV blocks with NIXL "
            "(or its Ray fallback, --kv-transport ray); pass nixl or leave it out"
        )
    base["disaggregation_transfer_backend"] = "nixl"
    prefill = {**base, "disaggregation_mode": "prefill"}
    decode = {**base, "disaggregation_mode": "decode"}
    decode.setdefault("disaggregation_decode_enable_radix_cache", True)
    for fields, tp, flag in ((prefill, prefill_tp, "--prefill-tp"), (decode, decode_tp, "--decode-tp")):
        if tp is not None:
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise ValueError(f"{flag} must be an integer >= 1 (got {tp!r})")
            fields["tp_size"] = tp
    return prefill, decode


def ranks_in_replica(config: Any, options: ServeOptions, pool: str) -> bool:
    """Whether a replica of ``pool`` runs its one rank in its own process (else in worker
    actors): always at ``tp_size`` 1, except that a PD replica with the Ray-object KV
    fallback needs its rank in an actor the other side can call."""
    if int(config.tp_size or 1) > 1:
        return False
    return pool == "colocated" or options.kv_transport != "ray"


def check_pd_options(prefill_config: Any, decode_config: Any, options: ServeOptions) -> None:
    """Refuse a PD setup that cannot work, with a message naming the flag and value."""
    from flotilla.cluster.engine.kv_handoff import check_policy
    from flotilla.cluster.engine.limits import block_size_for
    from flotilla.cluster.kv.endpoint import KV_TRANSPORTS

    if options.disaggregation_mode != "pd":
        raise ValueError(f"disaggregation_mode={options.disaggregation_mode!r}: build_pd_app needs 'pd'")
    for flag, count in (("--prefill-replicas", options.prefill_replicas), ("--decode-replicas", options.decode_replicas)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{flag} must be an integer >= 1 (got {count!r})")
    if options.kv_transport not in KV_TRANSPORTS:
        raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)} (got {options.kv_transport!r})")
    check_policy(options.kv_load_failure_policy)
    for flag, value in (("kv_lease_s", options.kv_lease_s), ("kv_transfer_timeout_s", options.kv_transfer_timeout_s)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive (got {value!r})")
    for role, config in (("prefill", prefill_config), ("decode", decode_config)):
        if config.disaggregation_mode != role:
            raise ValueError(f"the {role} pool's config has disaggregation_mode={config.disaggregation_mode!r}")
        if int(config.dcp_size or 1) > 1 or config.enable_dp_attention:
            raise ValueError(
                f"the {role} pool: PD moves a prompt's whole KV between engines; decode context parallelism "
                f"(dcp_size={config.dcp_size}) and DP attention (enable_dp_attention={config.enable_dp_attention}) "
                "are not supported with --disaggregation-mode pd"
            )
    pairs = (
        ("model_path", prefill_config.model_path, decode_config.model_path),
        ("kv_cache_dtype", prefill_config.kv_cache_dtype, decode_config.kv_cache_dtype),
        ("dtype", prefill_config.dtype, decode_config.dtype),
        ("page_size (KV block size)", block_size_for(prefill_config), block_size_for(decode_config)),
    )
    for what, a, b in pairs:
        if a != b:
            raise ValueError(f"prefill and decode pools must agree on {what}: prefill {a!r}, decode {b!r}")


# -- the ingress's client -----------------------------------------------------------------------

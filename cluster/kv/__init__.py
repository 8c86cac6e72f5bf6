"""cluster.kv: moving paged KV blocks between engines' ranks (prefill/decode disaggregation),
where it runs: inside each rank.

- :mod:`~flotilla.cluster.kv.transport`: one rank's transport (NIXL READs over UCX, or the
  Ray-object fallback), block and head layouts, compatibility checks;
- :mod:`~flotilla.cluster.kv.endpoint`: one rank's side across two TP groups (which peer rank
  serves which KV heads), built from a picklable factory;
- :mod:`~flotilla.cluster.kv.port`: the rank's endpoint as its runner holds it, with errors
  that name the rank.
"""

"""Flags, the model and the platform turned into one engine's resolved configuration: what
``LLM(...)`` does, and what the serving plan (:mod:`flotilla.serve.plan`) does for each of
its pools, so both resolve the same way.

- :func:`check_user_settings`: the user's flags against the runtime-support table, before
  anything starts (the model's config is read for the checks that depend on the checkpoint);
- :func:`resolve_engine_config`: the model source (``--model``, ``--revision``), the platform
  facts (probed on a worker node when none are given) and one call of ``resolve``.
"""

from __future__ import annotations

from typing import Any, Mapping

from flotilla.cluster.models.sources import ModelSource, resolve_model_source
from flotilla.cluster.platform import probe_for_workers
from flotilla.resolution import ModelFacts, PlatformFacts, ResolvedConfig, ServerArgs, resolve
from flotilla.resolution.runtime_support import check_runtime_support


def check_user_settings(given: Mapping[str, Any]) -> None:
    """Refuse every server field the user set that the runtime would not act on
    (:mod:`flotilla.resolution.runtime_support`): raises
    :class:`~flotilla.resolution.runtime_support.UnsupportedSettingsError` (an
    ``ArgumentError``) with one line per flag, or the ValueError of a model that cannot be
    found. ``given``: the server fields the user set (the ``--model`` value as ``model_path``)."""
    check_runtime_support(given)
    source = resolve_model_source(given.get("model_path"), given.get("revision"))
    check_runtime_support(given, ModelFacts.from_hf_config(source.config_dict))


def resolve_engine_config(
    fields: Mapping[str, Any], platform: PlatformFacts | None = None
) -> tuple[ResolvedConfig, ModelSource]:
    """Resolve one engine's configuration, once: ``(config, the model source)``.

    ``fields``: server fields by name; ``model_path`` is the ``--model`` value (absent or
    None: the embedded SmolLM2), resolved to a local path (``revision`` picks a snapshot of a
    hub id in the local HF cache). ``platform``: the facts to resolve for; None probes the
    Ray cluster's worker nodes when connected, else this machine. Runs no support check:
    callers check what the user set (:func:`check_user_settings`), not the fields a plan
    derives from it (a PD pool's role, an elastic joiner's ranks)."""
    given = dict(fields)
    source = resolve_model_source(given.pop("model_path", None), given.get("revision"))
    args = ServerArgs.create(model_path=str(source.path), **given)
    facts = platform if platform is not None else probe_for_workers()
    return resolve(args, ModelFacts.from_hf_config(source.config_dict), facts), source

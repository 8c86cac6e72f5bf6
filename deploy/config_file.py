"""``flotilla serve --config FILE``: a Ray Serve config file as ``flotilla serve``'s flags.

The file is what ``serve deploy`` / ``serve run`` take (``applications: [{import_path:
flotilla.serve.app:build, args: {...}}]``, see deploy/examples/), so one file serves
three ways::

    flotilla serve --config FILE [more flags]
    serve deploy FILE                     # or: serve run FILE
    ray job submit --working-dir . -- flotilla serve --config FILE --non-blocking

- The file must hold exactly one application whose ``import_path`` is
  ``flotilla.serve.app:build``; other applications are left alone (with a note).
- Its ``args`` become flags through the mapping ``build()`` uses
  (:func:`flotilla.serve.app.parse_build_args`): server fields by their SGLang names
  (``model`` or ``model_path``, ``tp_size``, ... as ``--model``, ``--tp-size``), the
  serving options (``router``, ``num_replicas``, the PD and ``elastic_ep_autoscale*``
  arguments) as the ``flotilla serve`` flags of the same names. ``placement``,
  ``placement_strategy`` (its mapping per pool has no flag; the ``--*placement-strategy``
  flags of the command line override it) and ``max_body_bytes`` are carried as values
  (:attr:`ServeConfigFile.placement`, :attr:`ServeConfigFile.placement_strategy`,
  :attr:`ServeConfigFile.max_body_bytes`).
- ``http_options.host`` / ``http_options.port``, when the file sets them, become
  ``--host`` / ``--port`` (unset: ``flotilla serve``'s own defaults, 127.0.0.1:30000).
- Flags given on the command line come after the file's, so they win. A boolean the
  file turns on stays on unless the flag has a ``--no-`` form.

Every error is an :class:`~flotilla.resolution.ArgumentError` naming the file, the key
and the value.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from flotilla.resolution import ArgumentError

CONFIG_FLAG = "--config"
# The import path (Serve also accepts the dotted spelling) of flotilla's application builder.
BUILD_IMPORT_PATHS = ("flotilla.serve.app:build", "flotilla.serve.app.build")
# build() arguments with no `flotilla serve` flag: carried as values.
CARRIED_ARGS = ("placement", "placement_strategy", "max_body_bytes")


@dataclass(frozen=True)
class ServeConfigFile:
    """The flotilla application of a Serve config file.

    Attributes:
        path: the file, as given.
        app_name: the application's ``name`` in the file.
        args: its ``args`` (keys with ``-`` spelled ``_``; None values dropped).
        host, port: ``http_options.host`` / ``.port`` when the file sets them, else None.
        notes: what ``flotilla serve`` leaves out of the file (other applications,
            per-deployment overrides), one line each, for the user.
    """

    path: str
    app_name: str
    args: dict[str, Any]
    host: str | None = None
    port: int | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def placement(self) -> dict[str, dict[str, float]]:
        """The ``placement`` argument (empty when absent), checked by
        :func:`~flotilla.serve.types.check_placement` at load."""
        return {group: dict(resources) for group, resources in (self.args.get("placement") or {}).items()}

    @property
    def placement_strategy(self) -> str | dict[str, str] | None:
        """The ``placement_strategy`` argument (None when absent): one strategy for every
        pool, or a mapping of pools to strategies; its strategies and pools checked by
        :func:`~flotilla.serve.types.pool_placement_strategies` at load, its pools against
        the mode when the flags are parsed."""
        value = self.args.get("placement_strategy")
        return dict(value) if isinstance(value, Mapping) else value

    @property
    def max_body_bytes(self) -> int | None:
        """The ``max_body_bytes`` argument, or None."""
        value = self.args.get("max_body_bytes")
        return None if value is None else int(value)


def split_config_flag(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Take ``--config FILE`` (or ``--config=FILE``) out of ``argv``: (FILE or None, the
    rest). :class:`ArgumentError` when it lacks a value or is given twice."""
    path, rest, args = None, [], list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "="):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                raise ArgumentError(f"{CONFIG_FLAG} expects a file: a Serve config YAML (e.g. deploy/examples/cpu-demo.yaml)")
            if path is not None:
                raise ArgumentError(f"{CONFIG_FLAG} given twice ({path} and {value}); pass one file")
            path = value
        else:
            rest.append(arg)
        i += 1
    return path, rest


def load_serve_config(path: str | Path) -> ServeConfigFile:
    """Read ``path`` (a Serve config YAML) and return its flotilla application.

    The file must be valid for Ray Serve itself (``ray.serve.schema.ServeDeploySchema``,
    what ``serve deploy`` checks) and hold exactly one application with
    ``import_path: flotilla.serve.app:build``. Its args are checked as ``build()`` would
    check them (unknown keys, bad values, ``placement``). Raises :class:`ArgumentError`
    naming the file, the key and the value.
    """
    import yaml

    where = str(path)
    file = Path(path).expanduser()
    if not file.is_file():
        state = "is a directory" if file.is_dir() else "does not exist"
        raise ArgumentError(f"{CONFIG_FLAG} {where}: the file {state}; pass a Serve config YAML (see deploy/examples/)")
    try:
        data = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ArgumentError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ArgumentError(
            f"{where}: a Serve config file is a mapping with an 'applications' list (got {type(data).__name__}: {data!r:.80})"
        )
    _check_serve_schema(where, data)
    apps = data.get("applications") or []
    ours = [(i, app) for i, app in enumerate(apps) if app.get("import_path") in BUILD_IMPORT_PATHS]
    if len(ours) != 1:
        found = ", ".join(f"applications[{i}] ({app.get('name')!r})" for i, app in ours) or "none"
        raise ArgumentError(
            f"{where}: expected exactly one application with import_path: {BUILD_IMPORT_PATHS[0]} (found {found}); "
            "flotilla serve deploys one flotilla application"
        )
    index, app = ours[0]
    name = str(app.get("name") or "default")
    notes = [
        f"{where}: applications[{i}] ({other.get('name')!r}, {other.get('import_path')}) is not flotilla's; "
        "flotilla serve leaves it out (serve deploy would deploy it)"
        for i, other in enumerate(apps)
        if i != index
    ]
    for key, why in (("deployments", "per-deployment overrides"), ("runtime_env", "its runtime_env")):
        if app.get(key):
            notes.append(f"{where}: applications[{index}].{key}: {why} apply under serve deploy, not flotilla serve")
    raw_args = app.get("args") or {}
    if not isinstance(raw_args, Mapping):
        raise ArgumentError(f"{where}: applications[{index}].args must be a mapping of flags (got args={raw_args!r})")
    args = {str(k).replace("-", "_"): v for k, v in raw_args.items() if v is not None}
    http = data.get("http_options") or {}
    port = http.get("port")
    if port is not None and not 0 < int(port) < 65536:
        raise ArgumentError(f"{where}: http_options.port={port!r}: a TCP port is between 1 and 65535")
    config = ServeConfigFile(
        path=where,
        app_name=name,
        args=args,
        host=None if http.get("host") is None else str(http["host"]),
        port=None if port is None else int(port),
        notes=tuple(notes),
    )
    for key, value in args.items():
        _check_arg(config, key, value)
    return config


def _check_serve_schema(where: str, data: dict) -> None:
    """Ray Serve's own validation (what ``serve deploy`` runs), one line per problem."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()[:5]
        )
        raise ArgumentError(f"{where}: not a valid Serve config file (serve deploy would refuse it too): {problems}") from None


def _check_arg(config: ServeConfigFile, key: str, value: Any) -> None:
    """Refuse ``key`` unless ``build()`` takes it with this value, with the file, key and value."""
    from flotilla.serve.types import check_placement, pool_placement_strategies

    try:
        if key in ("host", "port"):
            raise ArgumentError(
                f"the HTTP address is Serve's http_options.{key} in a Serve config file, not an application argument "
                f"(serve deploy would ignore it); move it to http_options.{key}"
            )
        if key == "placement":
            check_placement(value)
        elif key == "placement_strategy":
            pool_placement_strategies(dict(value) if isinstance(value, Mapping) else value)
        elif key == "max_body_bytes":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError("max_body_bytes must be a positive integer (bytes)")
        else:
            arg_flags(key, value)
    except (ArgumentError, ValueError) as exc:
        raise ArgumentError(f"{config.path}: args.{key}={value!r}: {exc}") from None


def arg_flags(key: str, value: Any) -> list[str]:
    """One ``build()`` argument as ``flotilla serve`` flags: a server field through the
    mapping ``build()`` uses; a serving option as the flag of the same name
    (``num_replicas: 2`` -> ``--num-replicas 2``; ``elastic_ep_autoscale: true`` ->
    ``--elastic-ep-autoscale``). :class:`ArgumentError` for an unknown key or a bad value;
    :data:`CARRIED_ARGS` have no flag (ValueError: a caller's mistake)."""
    from flotilla.serve.app import OPTION_ARGS, PD_OPTION_ARGS, _flag_argv
    from flotilla.serve.ep_autoscale_driver import AUTOSCALE_ARGS, elastic_autoscale_options

    if key in CARRIED_ARGS:
        raise ValueError(f"{key} has no flotilla serve flag; read it from ServeConfigFile.{key}")
    flag = "--" + key.replace("_", "-")
    if key == "disaggregation_mode":
        if str(value) not in ("pd", "null"):
            raise ArgumentError(
                "flotilla serve runs the prefill and decode pools itself: use pd (or null for one colocated pool)"
            )
        return [flag, str(value)]
    if key == "elastic_ep_autoscale":
        return [flag] if elastic_autoscale_options({key: value}).enabled else []
    if key in AUTOSCALE_ARGS:
        elastic_autoscale_options({"elastic_ep_autoscale": True, key: value})  # NOTE: checks the value
        return [flag, str(value)]
    if key in OPTION_ARGS or key in PD_OPTION_ARGS:
        return [flag, str(value)]
    return _flag_argv("model_path" if key == "model" else key, value)


def config_argv(config: ServeConfigFile, parser: argparse.ArgumentParser) -> list[str]:
    """The file's flags for ``flotilla serve`` (its args, then ``--host`` / ``--port``
    from ``http_options``), to go before the command line's own. Each argument's flags
    are first parsed alone by ``parser`` (``flotilla serve``'s), so a value the parser
    refuses is reported with the file, key and value."""
    argv: list[str] = []
    items = [(key, value) for key, value in config.args.items() if key not in CARRIED_ARGS]
    items += [(f"http_options.{key}", value) for key, value in (("host", config.host), ("port", config.port)) if value is not None]
    for key, value in items:
        flags = [f"--{key.split('.')[-1]}", str(value)] if key.startswith("http_options.") else arg_flags(key, value)
        if flags and key != "disaggregation_mode":
            try:
                _, unknown = parser.parse_known_args(flags)
                if unknown:
                    raise ArgumentError(f"flotilla serve has no flag {unknown[0]}")
            except ArgumentError as exc:
                place = key if key.startswith("http_options.") else f"args.{key}"
                raise ArgumentError(f"{config.path}: {place}={value!r}: {exc}") from None
        argv += flags
    return argv

"""``cuda_graph_config``: its plain-dict form and the helpers every phase reads it with.

The normalise phase turns the CUDA-graph flags into one mapping::

    {"decode":  {"backend": "full", "max_bs": 512, "bs": [1, 2, ...],
                 "tc_compiler": "eager", "full_prefill_max_req": None,
                 "full_prefill_prefix_chunk_tokens": None},
     "prefill": {...same keys...},
     "locked":  ["decode.backend", "prefill.max_bs", ...]}

``decode``/``prefill`` mirror SGLang's ``CudaGraphConfig`` phases. ``locked``
lists the ``phase.key`` settings the user (or a flag-level rule) pinned; it is
SGLang's ``_cuda_graph_config_locked`` set, kept inside the value so later
phases can honour it after the raw flags are gone.

Other phases should only use :func:`decode_graph_disabled`,
:func:`prefill_graph_disabled`, :func:`phase_backend`, :func:`is_locked` and
:func:`with_phase`; the layout above is this module's business.
"""

from __future__ import annotations

from typing import Any, Mapping

from flotilla.resolution.frozen import thaw

DECODE = "decode"
PREFILL = "prefill"
PHASES = (DECODE, PREFILL)

FULL = "full"
BREAKABLE = "breakable"
TC_PIECEWISE = "tc_piecewise"
DISABLED = "disabled"
BACKENDS = (FULL, BREAKABLE, TC_PIECEWISE, DISABLED)
ALLOWED_BACKENDS = {DECODE: BACKENDS, PREFILL: BACKENDS}

ALLOWED_KEYS = {
    DECODE: ("backend", "max_bs", "bs", "tc_compiler"),
    PREFILL: (
        "backend",
        "max_bs",
        "bs",
        "tc_compiler",
        "full_prefill_max_req",
        "full_prefill_prefix_chunk_tokens",
    ),
}
_PHASE_KEYS = ALLOWED_KEYS[PREFILL]  # every phase carries the full settings record
LOCKED = "locked"


# -- building -----------------------------------------------------------------


def default_prefill_backend(platform: Any) -> str:
    """Breakable prefill graphs are the default on CUDA only; elsewhere tc_piecewise."""
    return BREAKABLE if platform.is_cuda else TC_PIECEWISE


def _phase_defaults(backend: str) -> dict:
    return {
        "backend": backend,
        "max_bs": None,
        "bs": None,
        "tc_compiler": "eager",
        "full_prefill_max_req": None,
        "full_prefill_prefix_chunk_tokens": None,
    }


def default_config(platform: Any) -> dict:
    """The config with every setting at its default and nothing locked."""
    return {
        DECODE: _phase_defaults(FULL),
        PREFILL: _phase_defaults(default_prefill_backend(platform)),
        LOCKED: [],
    }


def json_input_error(raw: Any) -> str | None:
    """Why a user-given ``--cuda-graph-config`` JSON is unacceptable, or ``None``.

    Mirrors SGLang's argparse type for the flag (same messages).
    """
    if not isinstance(raw, Mapping):
        return f"--cuda-graph-config must be a JSON object, got {_json_type(raw)}"
    for phase, settings in raw.items():
        phase = str(phase)
        if phase not in PHASES:
            return f"--cuda-graph-config: unknown phase '{phase}', expected one of {PHASES}"
        if not isinstance(settings, Mapping):
            return (
                f"--cuda-graph-config['{phase}'] must be a JSON object, "
                f"got {_json_type(settings)}"
            )
        for key in settings:
            if key not in ALLOWED_KEYS[phase]:
                return (
                    f"--cuda-graph-config['{phase}']: unknown key '{key}', "
                    f"expected one of {ALLOWED_KEYS[phase]}"
                )
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, Mapping):
        return "dict"
    if isinstance(value, tuple):
        return "list"
    return type(value).__name__


def _raw_json(view: Any) -> Mapping:
    """The user's ``--cuda-graph-config`` JSON before the normalise phase built the dict."""
    raw = view.cuda_graph_config
    if isinstance(raw, Mapping) and LOCKED not in raw:
        return raw
    return {}


def build_config(view: Any, platform: Any) -> dict:
    """Merge the CUDA-graph flags into the config dict (SGLang's ``parse_cuda_graph_config``).

    Precedence, lowest first: defaults, ``--disable-cuda-graph``, the per-phase
    off switches, the per-phase convenience flags, the explicit JSON. Every
    setting a non-default source wrote is locked.
    """
    config = default_config(platform)
    locked: list[str] = []

    def pin(phase: str, key: str, value: Any) -> None:
        config[phase][key] = thaw(value)
        name = f"{phase}.{key}"
        if name not in locked:
            locked.append(name)

    if view.disable_cuda_graph:
        pin(DECODE, "backend", DISABLED)
        pin(PREFILL, "backend", DISABLED)
    if view.disable_prefill_cuda_graph:
        pin(PREFILL, "backend", DISABLED)
    if view.disable_decode_cuda_graph:
        pin(DECODE, "backend", DISABLED)
    convenience = (
        (DECODE, "backend", view.cuda_graph_backend_decode),
        (PREFILL, "backend", view.cuda_graph_backend_prefill),
        (DECODE, "max_bs", view.cuda_graph_max_bs_decode),
        (PREFILL, "max_bs", view.cuda_graph_max_bs_prefill),
        (DECODE, "bs", view.cuda_graph_bs_decode),
        (PREFILL, "bs", view.cuda_graph_bs_prefill),
    )
    for phase, key, value in convenience:
        if value is not None:
            pin(phase, key, value)
    if view.cuda_graph_tc_compiler is not None:
        pin(DECODE, "tc_compiler", view.cuda_graph_tc_compiler)
        pin(PREFILL, "tc_compiler", view.cuda_graph_tc_compiler)
    for phase, settings in _raw_json(view).items():
        if not isinstance(settings, Mapping):
            continue
        for key, value in settings.items():
            pin(phase, key, value)
    config[LOCKED] = sorted(locked)
    return config


# -- reading ------------------------------------------------------------------


def _built(view: Any) -> Mapping | None:
    config = getattr(view, "cuda_graph_config", None)
    if isinstance(config, Mapping) and LOCKED in config:
        return config
    return None


def phase_settings(config: Any, phase: str) -> dict:
    """A plain copy of one phase's settings of a built config."""
    return thaw(config[phase]) if isinstance(config, Mapping) and phase in config else {}


def phase_backend(view: Any, phase: str) -> str | None:
    """The graph backend of ``phase`` as resolved so far.

    Before the normalise phase has built the dict, the answer comes from the
    flags that feed it (``None``: the platform default, not decided yet).
    """
    built = _built(view)
    if built is not None:
        return built[phase]["backend"]
    raw = _raw_json(view).get(phase)
    if isinstance(raw, Mapping) and "backend" in raw:
        return raw["backend"]
    selected = getattr(view, f"cuda_graph_backend_{phase}")
    if selected is not None:
        return selected
    if view.disable_cuda_graph or getattr(view, f"disable_{phase}_cuda_graph"):
        return DISABLED
    return None


def decode_graph_disabled(view: Any) -> bool:
    """Decode CUDA graphs are switched off."""
    return phase_backend(view, DECODE) == DISABLED


def prefill_graph_disabled(view: Any) -> bool:
    """Prefill CUDA graphs are switched off."""
    return phase_backend(view, PREFILL) == DISABLED


def locked_settings(view: Any) -> frozenset[str]:
    """The pinned ``phase.key`` settings (SGLang's ``_cuda_graph_config_locked``)."""
    built = _built(view)
    if built is not None:
        return frozenset(built[LOCKED])
    return frozenset(_flag_locks(view))


def _flag_locks(view: Any) -> list[str]:
    names = []
    for phase in PHASES:
        if phase_backend(view, phase) is not None:
            names.append(f"{phase}.backend")
        for key in ("max_bs", "bs"):
            if getattr(view, f"cuda_graph_{key}_{phase}") is not None:
                names.append(f"{phase}.{key}")
        if view.cuda_graph_tc_compiler is not None:
            names.append(f"{phase}.tc_compiler")
        raw = _raw_json(view).get(phase)
        if isinstance(raw, Mapping):
            names.extend(f"{phase}.{key}" for key in raw)
    return names


def is_locked(view: Any, phase: str, key: str) -> bool:
    """Whether ``phase.key`` was pinned, so defaults and compatibility rules leave it."""
    return f"{phase}.{key}" in locked_settings(view)


# -- editing ------------------------------------------------------------------


def with_phase(config: Any, phase: str, **changes: Any) -> dict:
    """A plain copy of ``config`` with ``changes`` applied to one phase."""
    if phase not in PHASES:
        raise KeyError(phase)
    result = thaw(config) if isinstance(config, Mapping) else {}
    settings = dict(result.get(phase) or {})
    settings.update(thaw(changes))
    result[phase] = settings
    return result


# -- capture sizes ------------------------------------------------------------


def prefill_batch_sizes(max_bs: int) -> list[int]:
    """Prefill capture sizes (aggregate tokens) up to ``max_bs``."""
    ladder = (
        list(range(4, 33, 4))
        + list(range(48, 257, 16))
        + list(range(288, 513, 32))
        + list(range(576, 1024 + 1, 64))
        + list(range(1280, 4096 + 1, 256))
        + list(range(4608, max_bs + 1, 512))
    )
    return [size for size in ladder if size <= max_bs]


def decode_batch_sizes(max_bs: int, *, no_padding: bool, speculative: bool) -> list[int]:
    """Decode capture batch sizes up to ``max_bs`` (always including ``max_bs``).

    ``no_padding`` captures every size; speculative decoding uses a denser
    ladder at small sizes.
    """
    if no_padding:
        sizes = list(range(1, max_bs + 1))
    elif not speculative:
        sizes = (
            [1, 2, 4, 8, 12]
            + list(range(16, 257, 8))
            + list(range(272, 512, 16))
            + list(range(512, max_bs + 1, 32))
        )
    else:
        sizes = (
            list(range(1, 9))
            + list(range(10, 33, 2))
            + list(range(40, 65, 4))
            + list(range(72, 257, 8))
            + list(range(272, max_bs + 1, 16))
        )
    sizes = [size for size in sizes if size <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def cpu_batch_sizes(torch_compile_max_bs: int, *, no_padding: bool) -> list[int]:
    """CPU graph (torch.compile) batch sizes up to ``torch_compile_max_bs``."""
    limit = torch_compile_max_bs
    if no_padding:
        sizes = list(range(1, limit + 1))
    else:
        sizes = sorted(
            set().union(
                range(1, 17), range(18, 31, 2), range(32, 81, 4), range(84, limit + 1, 8), {limit}
            )
        )
    return [size for size in sizes if size <= limit]

"""Model loading format: GGUF detection, object-store/remote loaders, and the
remote-instance loader fallbacks (SGLang's ``handle_load_format``).

not ported: GGUF detection by file header (a model path that is a file without
the ``.gguf`` suffix; only config.json is ever read), Mistral native-format
detection (needs params.json / consolidated weights in the model directory,
which holds nothing but config.json), Mooncake TransferEngine probing (treated
as unavailable, as in the reference environment).
"""

from __future__ import annotations

import re

from flotilla.resolution.engine import reject, rule

_OBJECT_STORE_SCHEMES = ("s3://", "gs://", "az://")


def is_gguf_path(path) -> bool:
    """The model path names a ``.gguf`` file."""
    return isinstance(path, str) and path.endswith(".gguf")


def is_object_store_uri(path) -> bool:
    """An object-store URI the Run:ai streamer loads from."""
    return isinstance(path, str) and path.lower().startswith(_OBJECT_STORE_SCHEMES)


def is_remote_url(path) -> bool:
    """A ``<connector>://...`` URL."""
    return isinstance(path, str) and re.match(r"(.+)://(.*)", path) is not None


@rule("_gguf_quantization", overrides=("quantization",), whitelist=True)
def gguf_quantization(view, model, platform):
    """A GGUF checkpoint is served with GGUF quantization."""
    if view.load_format in ("auto", "gguf") and is_gguf_path(view.model_path):
        return {"quantization": "gguf"}
    return None


def _remote_instance_fallback(view) -> bool:
    """Whether the remote-instance loader lacks what it needs and falls back to auto."""
    backend = view.remote_instance_weight_loader_backend
    if backend != "modelexpress" and (
        view.remote_instance_weight_loader_seed_instance_ip is None
        or view.remote_instance_weight_loader_seed_instance_service_port is None
    ):
        return True
    if view.remote_instance_weight_loader_send_weights_group_ports is None and backend == "nccl":
        return True
    # NOTE: the TransferEngine backend needs Mooncake, which resolution treats as absent.
    return backend == "transfer_engine"


@rule(
    "_handle_load_format",
    overrides=(
        "load_format",
        "speculative_draft_load_format",
        "custom_weight_loader",
        "remote_instance_weight_loader_start_seed_via_transfer_engine",
    ),
)
def handle_load_format(view, model, platform):
    """The weight loader follows the model path (GGUF file, object store, remote URL).

    An incomplete remote-instance loader setup falls back to ``auto``."""
    declared: dict = {}
    load_format = view.load_format
    if load_format in ("auto", "gguf") and is_gguf_path(view.model_path):
        load_format = declared["load_format"] = "gguf"
    if is_object_store_uri(view.model_path):
        load_format = declared["load_format"] = "runai_streamer"
    elif is_remote_url(view.model_path):
        load_format = declared["load_format"] = "remote"
    if (
        view.speculative_draft_model_path is not None
        and is_object_store_uri(view.speculative_draft_model_path)
        and view.speculative_draft_load_format is None
    ):
        declared["speculative_draft_load_format"] = "runai_streamer"
    if view.custom_weight_loader is None:
        declared["custom_weight_loader"] = []
    if load_format == "remote_instance" and _remote_instance_fallback(view):
        load_format = declared["load_format"] = "auto"
    if view.remote_instance_weight_loader_start_seed_via_transfer_engine:
        declared["remote_instance_weight_loader_start_seed_via_transfer_engine"] = False
    if load_format == "ipc_cache":
        reject(
            "load_format='ipc_cache' is an internal-only format and must not "
            "be set directly. Enable the weight cache via --weight-cache-mode "
            "client (connect to an existing daemon) or daemon (launch one); "
            "that selects IPC loading automatically."
        )
    if view.weight_cache_mode != "off" and view.speculative_algorithm is not None:
        reject(
            "--weight-cache-mode is not supported together with speculative "
            "decoding (--speculative-algorithm): the weight cache daemon does "
            "not export the draft model's weights. Disable one of them "
            "(--weight-cache-mode off) for this configuration."
        )
    return declared

"""The tokenizer of a model source, through transformers' ``AutoTokenizer``, offline.

An HF directory's tokenizer files are read from the directory; a GGUF file's
tokenizer (vocabulary, merges, special tokens and chat template) is rebuilt by
transformers from the file's metadata. ``local_files_only=True`` always: nothing is
downloaded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from flotilla.cluster.models.sources import ModelSource

logger = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource | str | Path) -> Any:
    """A ``transformers`` tokenizer for ``source`` (a :class:`ModelSource`, or a path to a
    model directory or a ``.gguf`` file). ValueError when none can be built here."""
    from transformers import AutoTokenizer

    path = Path(source.tokenizer_source if isinstance(source, ModelSource) else source).expanduser().resolve()
    if path.is_file() and path.suffix.lower() == ".gguf":
        location, kwargs = path.parent, {"gguf_file": path.name}
        needs = "the GGUF file needs tokenizer.ggml.* metadata"
    elif path.is_dir():
        location, kwargs = path, {}
        needs = "the directory needs tokenizer.json, or tokenizer_config.json with its vocabulary files"
    else:
        raise ValueError(f"tokenizer source {str(path)!r} is neither a model directory nor a .gguf file")
    try:
        return AutoTokenizer.from_pretrained(str(location), local_files_only=True, **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {str(path)!r}: {needs} ({exc})") from None


def load_tokenizer_or_none(source: ModelSource, tokenizer_path: str | None = None) -> tuple[Any, str | None]:
    """``(tokenizer, None)``, or ``(None, why)`` when none can be built: a checkpoint without
    tokenizer files still serves token-id prompts. ``tokenizer_path`` (``--tokenizer-path``)
    names another place when it is not the model's own."""
    target: ModelSource | str = source if tokenizer_path in (None, "", str(source.path)) else tokenizer_path
    try:
        return load_tokenizer(target), None
    except ValueError as exc:
        logger.warning("no tokenizer, token-id prompts only: %s", exc)
        return None, str(exc)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path to a Jinja file, or the template text itself (None: the tokenizer's).
    ValueError naming the flag for anything else (named built-in templates are not shipped)."""
    if not value:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"chat_template {value!r} is neither a file nor Jinja template text; give a path to a "
        f".jinja file or the template itself"
    )

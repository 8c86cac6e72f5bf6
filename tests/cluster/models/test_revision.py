"""``--revision``: which snapshot of a hub id in the local HF cache loads (nothing is ever
downloaded), refused for the embedded model and for local paths."""

import pytest

from flotilla.cluster.models.sources import resolve_model_source
from helpers.tiny_models import save_tiny_llama

REPO = "flotilla-test/tiny-llama"
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A local HF cache holding two snapshots of one repo: ``main`` (vocab 256) and the tag
    ``v1`` (vocab 320), laid out as huggingface_hub lays them (refs/<name> -> commit)."""
    root = tmp_path / "hub"
    repo = root / ("models--" + REPO.replace("/", "--"))
    for ref, commit in COMMITS.items():
        save_tiny_llama(repo / "snapshots" / commit, vocab_size=256 if ref == "main" else 320)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    import huggingface_hub.constants

    # NOTE: huggingface_hub reads HF_HUB_CACHE once, at import; point both at this cache.
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    return root


def test_revision_picks_the_snapshot(hub_cache):
    assert resolve_model_source(REPO).path.name == COMMITS["main"]
    tagged = resolve_model_source(REPO, "v1")
    assert tagged.path.name == COMMITS["v1"] and tagged.config_dict["vocab_size"] == 320
    assert resolve_model_source(REPO, COMMITS["v1"]).path.name == COMMITS["v1"]


def test_llm_loads_the_revision(hub_cache):
    from flotilla import LLM

    llm = LLM(REPO, revision="v1", max_total_tokens=1024)
    assert llm.config.revision == "v1" and llm.engine.vocab_size == 320
    assert LLM(REPO, max_total_tokens=1024).engine.vocab_size == 256


def test_revision_is_refused_where_there_is_none(hub_cache, tmp_path):
    with pytest.raises(ValueError, match=r"not in the local HF cache at revision 'v9'"):
        resolve_model_source(REPO, "v9")
    with pytest.raises(ValueError, match=r"--revision v1: a revision picks a snapshot .* is the embedded model"):
        resolve_model_source(None, "v1")
    local = tmp_path / "local"
    save_tiny_llama(local)
    with pytest.raises(ValueError, match=r"is a local path; drop --revision"):
        resolve_model_source(str(local), "v1")

"""Platform presets, fact flips and fact files."""

import json

import pytest

from flotilla.resolution import PRESETS, ArgumentError, preset
from flotilla.resolution.platform import PlatformFacts, apply_flips, load_platform_file


def test_presets_carry_the_documented_facts():
    assert set(PRESETS) >= {"cpu", "a100", "h100", "h200", "b200", "b300", "gb200", "rtx-pro-6000", "mi300x", "mi355x"}
    h100, b300, rtx, gb200, mi355 = (preset(n) for n in ("h100", "b300", "rtx-pro-6000", "gb200", "mi355x"))
    assert h100.is_sm90 and not h100.is_sm100 and h100.device_sm == 90
    assert b300.is_sm100 and b300.is_blackwell and b300.device_sm == 103
    assert rtx.is_sm120 and rtx.is_blackwell and not rtx.is_sm100
    assert gb200.is_mnnvl_fabric and not preset("b200").is_mnnvl_fabric and gb200.device_count == 4
    assert mi355.is_hip and mi355.is_gfx95 and not mi355.flashinfer_available and mi355.torch_device == "cuda"
    assert preset("cpu").is_cpu and preset("cpu").device_sm == 0


def test_flips_change_one_fact_each():
    facts = apply_flips(preset("b200"), {"flashinfer": "false", "triton_kernels": "true", "driver_version": "595.0", "mnnvl": "true"})
    assert not facts.flashinfer_available and facts.triton_kernels
    assert facts.driver_version == (595, 0) and facts.driver_version >= (595,)
    assert facts.is_mnnvl_fabric


def test_bad_flips_are_named():
    with pytest.raises(ArgumentError, match="unknown platform fact 'warp'"):
        apply_flips(preset("h100"), {"warp": "1"})
    with pytest.raises(ArgumentError, match="flashinfer must be true or false, got 'maybe'"):
        apply_flips(preset("h100"), {"flashinfer": "maybe"})
    with pytest.raises(ArgumentError, match="unknown platform 'h300'"):
        preset("h300")


def test_platform_file_full_or_preset_based(tmp_path):
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"device": "cuda", "capability": [9, 0], "cuda_version": "12.4", "flashinfer": True}))
    facts = load_platform_file(full)
    assert facts.is_sm90 and facts.flashinfer_available
    based = tmp_path / "based.json"
    based.write_text(json.dumps({"preset": "b200", "flashinfer": False}))
    assert load_platform_file(based).is_sm100 and not load_platform_file(based).flashinfer
    assert PlatformFacts.from_json(preset("h200").to_json()) == preset("h200")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ArgumentError, match="not valid JSON"):
        load_platform_file(broken)

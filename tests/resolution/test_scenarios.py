"""Every reference scenario in ../shared/resolution-scenarios resolves as recorded."""

import json

import pytest

from helpers.scenarios import SCENARIO_DIR, check, scenario_files

FILES = scenario_files()


def test_scenario_data_is_present():
    assert FILES, f"no scenario files under {SCENARIO_DIR}; set FLOTILLA_SHARED"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_scenario(path, tmp_path):
    scenario = json.loads(path.read_text())
    problems = check(scenario, tmp_path)
    assert not problems, "\n".join(problems)

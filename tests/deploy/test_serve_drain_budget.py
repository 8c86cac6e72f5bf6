"""How long ``flotilla serve``'s drain may take (``drain_budget_s``): ``--shutdown-timeout``,
except inside a Ray job, where ``ray job stop`` SIGKILLs the driver ``RAY_JOB_STOP_WAIT_TIME_S``
(default 3) seconds after its SIGTERM: the drain leaves 2 s of that to shut Serve down."""

import pytest

from flotilla.deploy.serve_cmd import drain_budget_s

JOB = {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}  # NOTE: what Ray's job supervisor sets for the driver


@pytest.mark.parametrize(
    "environ, want",
    [
        ({}, 30.0),  # not a job: the whole --shutdown-timeout
        ({"RAY_JOB_STOP_WAIT_TIME_S": "5"}, 30.0),  # the variable alone does not make a job
        (JOB, 1.0),  # Ray's default 3 s, less the 2 s margin
        ({**JOB, "RAY_JOB_STOP_WAIT_TIME_S": "40"}, 30.0),  # room for the whole drain
        ({**JOB, "RAY_JOB_STOP_WAIT_TIME_S": "12"}, 10.0),
        ({**JOB, "RAY_JOB_STOP_WAIT_TIME_S": "1"}, 0.0),  # no room: no drain
        ({**JOB, "RAY_JOB_STOP_WAIT_TIME_S": "soon"}, 1.0),  # unreadable: Ray's default
    ],
)
def test_the_drain_fits_inside_ray_job_stop(environ, want):
    assert drain_budget_s(30.0, environ) == want

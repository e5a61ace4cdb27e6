"""The unit tier's guard (tests/conftest.py) can fail: these run as unit tests and try what it refuses."""

import subprocess
import sys

import pytest
import ray  # imported before the test starts, as code under test would have: ray.init is then refused

from tests.conftest import TierError


def test_a_unit_test_may_not_start_a_subprocess_or_a_ray_cluster():
    with pytest.raises(TierError, match=r"started a subprocess: mark it @pytest.mark.slow"):
        subprocess.run([sys.executable, "-c", "pass"])
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0  # provenance's git is allowed
    with pytest.raises(TierError, match=r"started a Ray cluster: mark it @pytest.mark.ray"):
        ray.init(num_cpus=1)  # refused before Ray is reached (a ray-tier test's cluster may be up already)


@pytest.mark.slow
def test_a_marked_test_may():
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout == "42\n"

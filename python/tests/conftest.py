import os

import numpy as np
import pytest

SEED = int(os.environ.get("OCTET_TEST_SEED", "20261201"))


def pytest_report_header(config):
    return f"octet tests: seed {SEED} (OCTET_TEST_SEED)"


@pytest.fixture
def rng():
    return np.random.default_rng(SEED)

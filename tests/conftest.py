import os

import pytest
import torch

from lmtier.testing.fixtures import *  # noqa: F401,F403  (redis_server, redis_url, redis_server_auth, redis_cluster)


def cuda_ok() -> bool:
    try:
        from lmtier import _C

        return _C.built_with_cuda() and _C.cuda_device_count() > 0 and torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if cuda_ok():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _close_engine_zygote():
    """After each module: end lmtier.testing.vllm.run_engine's zygote (its memory), if the module started it."""
    yield
    from lmtier.testing.vllm import close_zygote

    close_zygote()


@pytest.fixture
def managers():
    """A list a test appends the :class:`lmtier.manager.TierManager` s it builds to: each is closed
    (without persisting) after the test."""
    made = []
    yield made
    for m in made:
        m.close(persist=False)


@pytest.fixture
def make(tmp_path):
    """Factory of connector harnesses (``lmtier.testing.scheduler_harness.Harness``: vLLM's real
    ``Scheduler`` with both lmtier connector roles): ``make(**kw)``; each is closed after the test."""
    from lmtier.testing.scheduler_harness import Harness

    made = []

    def _make(**kw):
        h = Harness(tmp_path / f"h{len(made)}", **kw)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.close()
    os.environ.pop("LMTIER_FAULT_INJECT", None)

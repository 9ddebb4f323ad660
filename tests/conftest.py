import pytest
import torch

try:  # fixtures of the Redis helper (real redis-server)
    from tests.conftest_redis import *  # noqa: F401,F403
except ImportError:  # pragma: no cover
    pass


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

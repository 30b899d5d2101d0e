"""Shared test fixtures.

Async tests use anyio's built-in pytest plugin and run on both asyncio and trio unless a test
module overrides ``anyio_backend`` (only for components that genuinely require asyncio).
"""

from __future__ import annotations

import pytest

# The moto S3 server fixtures (s3_server, s3_bucket, dummy_aws_env) for the object-store tests.
pytest_plugins = ("s3server",)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

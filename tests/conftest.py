"""Shared test fixtures. The tests mirror the package tree (``tests/engine/`` for ``kvtier/engine/``, …);
module-level modules' tests sit here, multi-component scenarios in ``tests/scenarios/``.

Async tests use anyio's built-in pytest plugin and run on both asyncio and trio unless a test
module overrides ``anyio_backend`` (only for components that genuinely require asyncio).

Tests marked ``ucxx`` (the p2p tier's) need ucxx, which the ``test`` extra installs: in the test
virtualenv of the README it is there, so a missing ucxx stops the run with an error rather than
skipping them. Set ``KVTIER_ALLOW_NO_UCXX=1`` to skip them instead, where ucxx cannot be installed.
Tests marked ``gpu`` are skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# Test helpers shared by the folders (peer processes, the moto S3 server, KV block fillers) live in
# tests/support and are imported by name.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# The moto S3 server fixtures (s3_server, s3_bucket, dummy_aws_env) for the object-store tests.
pytest_plugins = ("s3server",)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _require_ucxx([item for item in items if "ucxx" in item.keywords])
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _require_ucxx(items: list[pytest.Item]) -> None:
    # Looked up, not imported: kvtier configures UCX before its first import of ucxx.
    if not items or importlib.util.find_spec("ucxx") is not None:
        return
    if os.environ.get("KVTIER_ALLOW_NO_UCXX") == "1":
        skip = pytest.mark.skip(reason="needs ucxx (the p2p extra); skipped: KVTIER_ALLOW_NO_UCXX=1")
        for item in items:
            item.add_marker(skip)
        return
    raise pytest.UsageError(
        f"{len(items)} selected tests need ucxx, which cannot be found: install the test extra "
        "(pip install 'kvtier[test]', README) or set KVTIER_ALLOW_NO_UCXX=1 to skip them"
    )

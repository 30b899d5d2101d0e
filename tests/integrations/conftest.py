"""The vLLM integration suite: runs where vLLM 0.33 is importable (`.ci/run`'s side virtualenv).

In the main virtualenv vLLM is absent and these files are not collected at all (they are not
skipped: nothing here counts as run). With ``KVTIER_REQUIRE_VLLM=1`` (set by ``.ci/run``) a
missing vLLM is an error instead, so CI can never pass without running them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

try:
    import vllm.v1.kv_offload.tiering.spec  # noqa: F401
except ImportError as exc:
    if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
        raise pytest.UsageError(
            f"KVTIER_REQUIRE_VLLM=1 but vLLM cannot be imported here ({exc}); build the side "
            "virtualenv with scripts/vllm_venv.sh (README, 'Using kvtier from vLLM')"
        ) from exc
    collect_ignore_glob = ["test_*.py"]
    VLLM_VERSION = None
else:
    import vllm

    VLLM_VERSION = vllm.__version__


def pytest_report_header(config: pytest.Config) -> str:
    if VLLM_VERSION is None:
        return "tests/integrations: not collected (vLLM is not installed; see README 'Using kvtier from vLLM')"
    return f"tests/integrations: against vLLM {VLLM_VERSION}"


_ABSENT = object()


@pytest.fixture
def vllm_globals() -> Iterator[None]:
    """``init_none_hash`` sets module globals of vLLM: put back what was there."""
    from vllm.v1.core import kv_cache_utils

    names = ("NONE_HASH", "_NONE_HASH_SEED")
    saved = {name: getattr(kv_cache_utils, name, _ABSENT) for name in names}
    yield
    for name, value in saved.items():
        if value is _ABSENT:
            if hasattr(kv_cache_utils, name):
                delattr(kv_cache_utils, name)
        else:
            setattr(kv_cache_utils, name, value)

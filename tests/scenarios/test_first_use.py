"""What a first-time user meets: the README's and docs' programs, the extras, the blocking facade,
per-request key typos, redaction of short secrets, the obj example without pytest."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier.config import RequestParams
from kvtier.errors import ConfigError, EngineClosedError
from kvtier.layout import KVGeometry

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
EMBEDDING_DOC = REPO_ROOT / "docs" / "embedding.md"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ------------------------------------------------------------------------------ README program


def readme_program(heading: str, document: Path = README) -> str:
    """The first ```python block of the section ``heading`` of ``document`` (the README), verbatim."""
    text = document.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    match = re.search(r"^```python\n(.*?)^```$", section, re.S | re.M)
    assert match, f"no ```python block in the section {heading!r}"
    return match.group(1)


def readme_embedding_program() -> str:
    return readme_program("## Embedding kvtier")


def run_program(program: str, tmp_path: Path) -> list[str]:
    """Run ``program`` as a script in a fresh interpreter, as a reader would; its stdout lines."""
    script = tmp_path / "readme_program.py"
    script.write_text(program, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_the_readme_program_is_complete() -> None:
    program = readme_embedding_program()
    for needed in ("import asyncio", "import torch", "import kvtier", "asyncio.run(", "prompt =",
                   "block_ids =", "device_prefix_hit =", 'device="cuda"'):
        assert needed in program, needed
    assert "block_ids[i]" in program  # the comment on what block ids are and how many


def test_the_readme_program_runs_on_cpu(tmp_path: Path) -> None:
    assert run_program(readme_embedding_program(), tmp_path) == [
        "first request: 0 tokens loaded, 100 to compute",
        "second request: 96 tokens loaded, 4 to compute",
    ]


def test_the_documented_layerwise_program_runs_on_cpu(tmp_path: Path) -> None:
    program = readme_program("## Layer-wise loading", EMBEDDING_DOC)
    for needed in ("import kvtier", "asyncio.run(", "load_layerwise(", "async for group in layers",
                   "except kvtier.LayerwiseLoadError"):
        assert needed in program, needed
    assert run_program(program, tmp_path) == ["96 tokens arrive layer by layer, 4 to compute"]


def test_the_readme_lists_the_extras() -> None:
    text = README.read_text(encoding="utf-8")
    for extra in ("obj", "bench", "test"):
        assert f"pip install 'kvtier[{extra}]'" in text or f'".[{extra}]"' in text
        assert f"| `{extra}` |" in text


# ------------------------------------------------------------------------------ missing extras

GEOMETRY = KVGeometry("first-use/model", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                      block_size=4)


def test_obj_tier_without_aiobotocore_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aiobotocore", None)
    config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 4 * GEOMETRY.slot_bytes(1),
        "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "127.0.0.1:9"}}],
    }
    with pytest.raises(ConfigError) as caught:
        kvtier.start_in_thread(config, GEOMETRY, flush_timeout_s=0)
    message = str(caught.value)
    assert message.startswith("secondary_tiers[0].type: the 'obj' tier needs the aiobotocore package")
    assert "pip install 'kvtier[obj]'" in message


def test_bench_chart_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvtier.bench.report import write_chart

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    skipped = write_chart(str(tmp_path / "chart.png"), [], "title")
    assert skipped is not None and "pip install 'kvtier[bench]'" in skipped


# ------------------------------------------------------------------------------ ThreadedEngine


def _device_kv(blocks: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (blocks, 2, GEOMETRY.block_size, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    return [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(GEOMETRY.num_layers)]


def test_threaded_engine_offers_what_the_readme_names(tmp_path: Path) -> None:
    config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8 * GEOMETRY.slot_bytes(1),
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}],
    }
    kv = _device_kv()
    prompt = list(range(1, 4 * 3 + 2))  # 3 chunks and 1 token
    engine = kvtier.start_in_thread(config, GEOMETRY, kv)
    try:
        keys = engine.chunk_keys(prompt)
        assert len(keys) == 3 and all(isinstance(k, bytes) for k in keys)
        assert engine.store(prompt, [0, 1, 2, 3]) == 12
        engine.drain()  # the cascade to the fs tier finished
        assert engine.cached_prefix_tokens(prompt) == 12
        engine.reset_cache()  # host memory emptied; the fs tier keeps its chunks
        assert engine.statistics()["0:primary"].used_slots == 0
        outcome = engine.load_with_sources(prompt, [8, 9, 10, 11])
        assert outcome.tokens == 12 and outcome.tokens_by_tier == {"1:fs": 12}
        assert all(torch.equal(layer[0:3], layer[8:11]) for layer in kv)
        assert engine.load(prompt, [12, 13, 14, 15]) == 12
        exposition = engine.metrics.render().decode()
        assert "kvtier_kv_offload_tiering_chunk_hits_total" in exposition
        assert engine.metrics_server is None
        stats = engine.statistics()
        assert "0:primary" in stats and "1:fs" in stats
    finally:
        engine.close()
    for call in (lambda: engine.chunk_keys(prompt), engine.reset_cache, engine.drain):
        with pytest.raises(EngineClosedError):
            call()
    assert engine.metrics.registry is not None  # still readable: the final values
    assert "0:primary" in engine.statistics()


# ------------------------------------------------------------------------------ request params


@pytest.fixture
def fresh_typo_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.config.request as config_module

    monkeypatch.setattr(config_module, "judged_request_keys", set())


def test_a_likely_typo_of_a_request_key_warns_once_with_the_suggestion(
        caplog: pytest.LogCaptureFixture, fresh_typo_memory: None) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        params = RequestParams.from_kv_transfer_params({"max_load_token": 5})
        RequestParams.from_kv_transfer_params({"max_load_token": 5})  # the same typo again: silent
    assert params.max_load_tokens is None  # ignored, not guessed
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["kv_transfer_params: unknown key 'max_load_token' is ignored "
                        "(did you mean 'max_load_tokens'?) (warned once per key)"]


def test_other_unknown_request_keys_stay_silent(caplog: pytest.LogCaptureFixture, fresh_typo_memory: None) -> None:
    vllm_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "e",
                   "remote_block_ids": [1], "remote_host": "h", "remote_port": 1, "remote_request_id": "r",
                   "max_tokens": 3, "lora_name": "x", "anything_else": 1}
    with caplog.at_level(logging.DEBUG, logger="kvtier.config"):
        params = RequestParams.from_kv_transfer_params({**vllm_params, "max_load_tokens": 16})
    assert params.max_load_tokens == 16
    assert caplog.records == []


# ------------------------------------------------------------------------------ redaction


def test_short_secrets_do_not_mangle_words_and_never_appear_as_tokens() -> None:
    from kvtier.tiers.obj import _secret_pattern, _SecretRedactor, redact_secrets

    text = "bucket 'data' at http://127.0.0.1: Credential=ab/20260101 secret a, key ab"
    assert redact_secrets(text, ["a", "ab"]) == (
        "bucket 'data' at http://127.0.0.1: Credential=***/20260101 secret ***, key ***")
    redactor = _SecretRedactor()
    redactor._secrets.update(["a", "ab"])
    redactor._pattern = _secret_pattern(["a", "ab"])  # as add() sets it, without attaching to loggers
    assert redactor.redact(text) == redact_secrets(text, ["a", "ab"])


def test_long_secrets_are_redacted_everywhere() -> None:
    from kvtier.tiers.obj import redact_secrets

    secret = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY"
    text = f"sig={secret}&x=y{secret}z; Authorization: AWS4 Credential=AKIDEXAMPLE00001/2026"
    out = redact_secrets(text, [secret, "AKIDEXAMPLE00001", ""])
    assert secret not in out and "AKIDEXAMPLE00001" not in out
    assert out == "sig=***&x=y***z; Authorization: AWS4 Credential=***/2026"


def test_the_log_filter_redacts_short_secrets_as_tokens_only(caplog: pytest.LogCaptureFixture) -> None:
    from kvtier.tiers.obj import _REDACTOR

    log = logging.getLogger("botocore.kvtier_first_use_test")
    _REDACTOR.add(["ab", "s3cr3t-key-long-enough"])
    try:
        with caplog.at_level(logging.INFO, logger="botocore"):
            log.info("about ab: %s tab", "s3cr3t-key-long-enough")
    finally:
        _REDACTOR.remove(["ab", "s3cr3t-key-long-enough"])
    assert [r.getMessage() for r in caplog.records] == ["about ***: *** tab"]


# ------------------------------------------------------------------------------ obj example


def _run_obj_example(hidden: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    code = ("import runpy, sys\n"
            f"for name in {hidden!r}:\n    sys.modules[name] = None\n"
            "sys.argv = ['obj_tier.py']\n"
            f"runpy.run_path({str(REPO_ROOT / 'examples' / 'obj_tier.py')!r}, run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)


def test_obj_example_runs_without_pytest() -> None:
    proc = _run_obj_example(("pytest", "_pytest", "hypothesis"))
    assert proc.returncode == 0, proc.stderr
    assert "engine B loaded 96 tokens, by tier {'1:obj': 96}; bytes identical: True" in proc.stdout


def test_obj_example_without_moto_says_so_and_exits_2() -> None:
    proc = _run_obj_example(("moto", "moto.server"))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs moto's server" in lines[0] and "--endpoint" in lines[0]

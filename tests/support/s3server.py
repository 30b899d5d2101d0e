"""A local S3 server for tests: moto's server on 127.0.0.1, nothing off the machine.

``S3Server`` wraps ``moto.server.ThreadedMotoServer`` on a free loopback port and can be stopped
and restarted on the same port (moto keeps its buckets in process memory, so objects survive a
restart — exactly what an outage-and-recovery test needs). The fixtures set the AWS credential
environment variables to dummies and disable the EC2 metadata lookup, so no SDK default chain
ever reaches for real credentials or the network.

``tests/conftest.py`` registers this module as a pytest plugin, so every test can ask for the
``s3_server``, ``s3_bucket`` and ``dummy_aws_env`` fixtures.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator

import pytest

__all__ = ["DUMMY_ACCESS_KEY", "DUMMY_SECRET_KEY", "S3Server", "free_port", "s3_server", "s3_bucket",
           "dummy_aws_env"]

DUMMY_ACCESS_KEY = "AKIDTESTDUMMYKEY0001"
DUMMY_SECRET_KEY = "dummy-secret-never-logged-0001"

_DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": DUMMY_ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET_KEY,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never probe IMDS (169.254.169.254)
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Server:
    """moto's S3 server on ``127.0.0.1:port``; ``stop``/``start`` may be repeated (same port)."""

    def __init__(self, port: int | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = port if port is not None else free_port()
        self._server: object | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` — the ``store_config.endpoint_override`` value."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> S3Server:
        from moto.server import ThreadedMotoServer

        if self._server is not None:
            return self
        # werkzeug logs every request at INFO; keep test and example output readable.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        deadline = time.monotonic() + 5.0
        while True:  # the port may linger briefly after a stop
            server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
            try:
                server.start()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._server = server
        self._wait_listening()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()  # type: ignore[attr-defined]

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 5.0
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def client(self):  # -> botocore S3 client (sync, for fixtures and assertions)
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.url, region_name="us-east-1",
            aws_access_key_id=DUMMY_ACCESS_KEY, aws_secret_access_key=DUMMY_SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name by default) and return its name."""
        name = name or f"kvtier-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def dummy_aws_env() -> Iterator[None]:
    """Dummy AWS credentials and no metadata lookups for the whole session."""
    saved = {key: os.environ.get(key) for key in _DUMMY_ENV}
    os.environ.update(_DUMMY_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def s3_server(dummy_aws_env: None) -> Iterator[S3Server]:
    """One moto S3 server on loopback for the session (tests use their own buckets)."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on :func:`s3_server`."""
    return s3_server.create_bucket()

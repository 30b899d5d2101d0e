"""GPU acceptance check: the CUDA-only tests, then the CUDA copy bandwidth, in one summary.

Runs ``pytest -m gpu`` and ``benchmarks/host_copy.py --device cuda`` (GiB/s per direction for
2 MiB and 16 MiB chunks, cross-layer and per-layer device layouts). Exits non-zero when CUDA is
absent, when a GPU test fails, or when the benchmark fails.

    python scripts/gpu_check.py [--total 256M] [--repeats 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in the repository root; (exit status, combined output), echoing the output."""
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        return 124, out if isinstance(out, str) else out.decode(errors="replace")
    print(proc.stdout, end="")
    return proc.returncode, proc.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", default="256M", help="bytes per direction per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)

    test_rc, test_out = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"], 600)
    bench_rc, bench_out = run(
        [
            sys.executable, "benchmarks/host_copy.py", "--device", "cuda", "--sizes", "2M,16M",
            "--total", args.total, "--repeats", str(args.repeats),
        ],
        600,
    )

    test_summary = next(
        (line for line in reversed(test_out.splitlines()) if " passed" in line or " failed" in line or "error" in line),
        f"pytest exited {test_rc}",
    )
    print("\n=== gpu_check summary ===")
    print(f"device: {device}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"gpu tests: {'OK' if test_rc == 0 else 'FAILED'} ({test_summary.strip()})")
    if bench_rc == 0:
        table = [line for line in bench_out.splitlines() if line.strip()]
        print("copy bandwidth (GiB/s):")
        for line in table:
            print(f"  {line}")
    else:
        print(f"copy bandwidth: FAILED (exit {bench_rc})")
    return 0 if test_rc == 0 and bench_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

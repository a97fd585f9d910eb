"""The whole app on one GPU machine, in one prepared call: the CUDA tests, papers'-shape runs of
FedAvg, FedMR and FedCross on the in-process engine beside the plain loop on the same GPU, and
the local-training throughput bench.

    python bench/gpu_session.py wheels                       # here: the wheels the GPU machine lacks -> .whl/
    python bench/gpu_session.py run --out "$OUT"              # there (.whl carried): install, run, JSON under $OUT
    python bench/gpu_session.py run --device cpu --rounds 2 --strategies fedavg --quick --out /tmp/s   # the dry run

**Here** (``wheels``): the machine lent for GPU work has Python 3.12, PyTorch with CUDA and many
common packages, but not Flower, hydra, the datasets stack or the app's other requirements, and
no network. The command walks the requirement tree of the installed ``fedmm`` (its extras left
out: so no Ray, whose wheel alone exceeds what may travel), drops what the GPU machine has
(``DEVICE_PACKAGES``) and what is never imported (``NEVER_IMPORTED``), and downloads each of the
rest for CPython 3.12 on x86-64 Linux into ``.whl/`` (a pure-Python package published only as a
source archive is built into a wheel here). It refuses to end above ``--budget-mib`` (the wheels
travel with the working tree, 64 MiB in all). ``--list`` prints the plan without downloading.

**There** (``run``): installs ``.whl/*.whl`` into a private folder when ``flwr`` is not
importable (``pip install --no-index --no-deps --target``), checks that the app imports, then
runs each step as a child process with its own time limit, all within ``--budget-s`` (default
510 s, so the call ends inside 9 minutes), writing ``gpu_session.json`` under ``--out`` after
every step (what ran, how long, its exit status and output tail) beside the step's own files:

1. ``cuda_tests``: ``pytest -m cuda`` (tests/test_cuda.py; skipped where no CUDA device is);
2. ``e2e``: ``bench/e2e_overhead.py --workload papers --runners plain local vectorized`` with
   ``training.device=<device>``: the in-process engine, one client at a time and each round's
   clients as one computation, against the plain loop, each of ``--strategies``, ``--rounds``
   rounds (``e2e.json``);
3. ``throughput``: ``bench/gpu_throughput.py --device <device>`` (``gpu_throughput.json``);
4. ``vectorized``: ``bench/vectorized_throughput.py --device <device>``: clients per second one
   at a time against as one computation, lenet, cnn and resnet20, K = 10 and 100, batch 10 and
   50, with GPU memory per client (``vectorized_throughput.json``);
5. ``cifar_round``: the same for a round of the papers' CIFAR-10 shape (10 clients of 500
   images, 5 epochs, batch 50; lenet and resnet20) and 2,000 rounds of it projected
   (``cifar_round.json``).

``--quick`` shrinks every step to a smoke run (4 clients, 1 epoch, one throughput case): the dry
run on the CPU, tests/test_gpu_session.py.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".whl"

#: Python packages of the GPU machine's image (its KINDS list, 2026-11-17), normalised names.
DEVICE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio interface-meta iniconfig jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
#: Requirements that nothing on the app's path imports: ``uv`` is the installer binary Flower's
#: SuperLink calls for an app's dependencies (17.6 MB), the app itself.
NEVER_IMPORTED = frozenset({"uv", "fedmm"})
#: pip's platform tags for the GPU machine (CPython 3.12, x86-64 Linux).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_tree(root: str = "fedmm") -> dict[str, str]:
    """Every distribution ``root`` needs, as installed here (name -> version), extras left out."""
    from packaging.requirements import Requirement

    found: dict[str, str] = {}

    def visit(name: str) -> None:
        key = normalised(name)
        if key in found:
            return
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_session: {name} is required but not installed here; run from the app's venv") from None
        found[key] = dist.version
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                visit(requirement.name)

    visit(root)
    return found


def wheel_plan() -> dict[str, str]:
    """The distributions to carry: the requirement tree minus the GPU machine's and the unused."""
    return {name: version for name, version in sorted(requirement_tree().items())
            if name not in DEVICE_PACKAGES and name not in NEVER_IMPORTED}


def download_wheels(plan: dict[str, str], dest: Path, budget_mib: float) -> list[dict[str, Any]]:
    """``pip download`` each planned wheel for the GPU machine into ``dest`` (a source-only,
    pure-Python package: built into a wheel here)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    platform_args = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    for name, version in plan.items():
        spec = f"{name}=={version}"
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platform_args, "-d", str(dest), spec]
        if subprocess.run(download, capture_output=True, text=True).returncode != 0:
            build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-binary", name, "-w", str(dest), spec]
            done = subprocess.run(build, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"gpu_session: no wheel of {spec} for CPython 3.12 / x86-64 Linux:\n{done.stderr[-2000:]}")
            built = [w for w in dest.glob(f"{re.sub('-', '_', name)}-{version}-*.whl")]
            if built and not all(w.name.endswith("-none-any.whl") for w in built):
                raise SystemExit(f"gpu_session: {spec} has no wheel for the GPU machine and is not pure Python")
    wheels = [{"file": w.name, "bytes": w.stat().st_size} for w in sorted(dest.glob("*.whl"))]
    total = sum(w["bytes"] for w in wheels) / 2**20
    if total > budget_mib:
        raise SystemExit(f"gpu_session: the wheels take {total:.1f} MiB, over --budget-mib {budget_mib:g}: "
                         + ", ".join(f"{w['file']} {w['bytes'] / 2**20:.1f}" for w in wheels))
    return wheels


# =============================================================================== there
def child_env(site: Path | None) -> dict[str, str]:
    """The children's environment: the installed wheels (when any) and the repository importable."""
    paths = [str(site)] if site is not None else []
    paths.append(str(REPO))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1", "FLWR_TELEMETRY_ENABLED": "0",
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def install_wheels(target: Path) -> Path | None:
    """Install ``.whl/*.whl`` into ``target`` when this Python cannot import Flower; the folder
    (None when nothing was needed)."""
    try:
        import flwr  # noqa: F401
        import hydra  # noqa: F401
        return None
    except ImportError:
        pass
    wheels = sorted(str(w) for w in WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu_session: flwr is not importable and there are no wheels in {WHEELS} "
                         "(run `python bench/gpu_session.py wheels` here first and carry .whl)")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *wheels], check=True)
    return target


def machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                            "torch": torch.__version__, "device": device, "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cudnn=torch.backends.cudnn.version())
    return info


class Session:
    """The steps of one call, each a child process with a time limit, all within a budget."""

    def __init__(self, out: Path, budget_s: float, env: dict[str, str], record: dict[str, Any]) -> None:
        self.out, self.env, self.record = out, env, record
        self.deadline = time.monotonic() + budget_s
        record.setdefault("steps", [])

    def save(self) -> None:
        (self.out / "gpu_session.json").write_text(json.dumps(self.record, indent=2))

    def step(self, name: str, cmd: list[str], limit_s: float) -> int:
        left = self.deadline - time.monotonic()
        entry: dict[str, Any] = {"step": name, "command": " ".join(cmd[1:])}
        if left < 10:
            entry.update(status="skipped", reason="the session's time budget is spent")
            self.record["steps"].append(entry)
            self.save()
            return 1
        limit = min(limit_s, left)
        start = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=limit)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as err:
            code = 124
            output = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        entry.update(status="ok" if code == 0 else "failed" if code != 124 else "timed out", exit=code,
                     seconds=round(time.monotonic() - start, 1), limit_s=round(limit, 1), output_tail=output[-4000:])
        self.record["steps"].append(entry)
        self.save()
        print(f"gpu_session: {name}: {entry['status']} in {entry['seconds']} s", flush=True)
        return code


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    site = install_wheels(Path(args.site))
    env = child_env(site)
    record: dict[str, Any] = {"argv": sys.argv[1:], "wheels_installed": site is not None, "machine": machine(args.device)}
    session = Session(out, args.budget_s - (time.monotonic() - started), env, record)
    session.save()
    py = sys.executable
    if session.step("imports", [py, "-c", "import launch.cli, server_app.runner, client_app.client_app, fedmm.local_engine; "
                                          "import sys; assert 'ray' not in sys.modules, 'ray was imported'"], 120) != 0:
        return 1
    session.step("cuda_tests", [py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
                                f"--junitxml={out / 'cuda_tests.xml'}"], args.tests_s)
    e2e = [py, "bench/e2e_overhead.py", "--workload", "papers", "--runners", "plain", "local", "vectorized", "--rounds", str(args.rounds),
           "--strategies", *args.strategies, "--override", f"training.device={args.device}", "--workdir",
           str(Path(args.site).parent / "e2e-runs"), "--out", str(out / "e2e.json")]
    if args.quick:
        e2e += ["--clients-per-round", "2", "--local-epochs", "1"]  # the papers' 100 clients (40 images each), 2 per round
    session.step("e2e", e2e, args.e2e_s)
    throughput = [py, "bench/gpu_throughput.py", "--device", args.device, "--out", str(out / "gpu_throughput.json")]
    if args.quick:
        throughput += ["--models", "cnn", "--clients", "1", "--samples-per-client", "50", "--repeats", "1"]
    else:
        throughput += ["--clients", "1", "2", "4", "8", "--repeats", "3"]
    session.step("throughput", throughput, args.throughput_s)
    vectorized = [py, "bench/vectorized_throughput.py", "--device", args.device, "--out", str(out / "vectorized_throughput.json")]
    vectorized += ["--models", "lenet", "--clients", "2", "--batch-sizes", "10", "--repeats", "1"] if args.quick else ["--repeats", "2"]
    session.step("vectorized", vectorized, args.vectorized_s)
    cifar = [py, "bench/vectorized_throughput.py", "--device", args.device, "--models", "lenet", "resnet20", "--shape", "cifar",
             "--batch-sizes", "50", "--projected-rounds", "2000", "--out", str(out / "cifar_round.json")]
    cifar += (["--clients", "2", "--samples-per-client", "60", "--epochs", "1", "--repeats", "1"] if args.quick
              else ["--clients", "10", "--samples-per-client", "500", "--epochs", "5", "--repeats", "2"])
    session.step("cifar_round", cifar, args.cifar_s)
    record["seconds"] = round(time.monotonic() - started, 1)
    session.save()
    return 0 if all(s["status"] == "ok" for s in record["steps"]) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    wheels = sub.add_parser("wheels", help="here: download the wheels the GPU machine lacks into .whl/")
    wheels.add_argument("--list", action="store_true", help="print the plan, download nothing")
    wheels.add_argument("--budget-mib", type=float, default=48.0, help="the most the wheels may take (they travel with the tree)")
    there = sub.add_parser("run", help="there: install the wheels, then the CUDA tests, the e2e runs, the throughput bench")
    there.add_argument("--out", required=True, help="where the JSON results go ($OUT on the GPU machine)")
    there.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    there.add_argument("--rounds", type=int, default=10)
    there.add_argument("--strategies", nargs="+", default=["fedavg", "fedmr", "fedcross"])
    there.add_argument("--quick", action="store_true", help="smoke-sized steps (the dry run)")
    there.add_argument("--budget-s", type=float, default=510.0, help="seconds for the whole call")
    there.add_argument("--tests-s", type=float, default=90.0)
    there.add_argument("--e2e-s", type=float, default=170.0)
    there.add_argument("--throughput-s", type=float, default=70.0)
    there.add_argument("--vectorized-s", type=float, default=90.0)
    there.add_argument("--cifar-s", type=float, default=60.0)
    there.add_argument("--site", default="/tmp/fedmm-gpu/site", help="where the wheels are installed")
    args = parser.parse_args(argv)
    if args.command == "wheels":
        plan = wheel_plan()
        print("gpu_session: wheels to carry: " + ", ".join(f"{n}=={v}" for n, v in plan.items()), flush=True)
        if args.list:
            return 0
        wheels_done = download_wheels(plan, WHEELS, args.budget_mib)
        total = sum(w["bytes"] for w in wheels_done) / 2**20
        print(f"gpu_session: {len(wheels_done)} wheels, {total:.1f} MiB in {WHEELS} (name it in `carry`)", flush=True)
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())

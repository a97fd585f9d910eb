"""The whole app on one GPU machine, in one prepared call that pays off even when cut short: the
CUDA tests, papers'-shape runs of FedAvg, FedMR and FedCross on the in-process engine beside the
plain loop on the same GPU, vectorized throughput, a CIFAR-shaped round, local-training throughput.

    python bench/gpu_session.py wheels                          # here: the wheels the GPU machine lacks -> .whl/
    python3 bench/gpu_session.py run --out "$OUT"                # there (.whl carried): install, run, JSON under $OUT
    python3 bench/gpu_session.py run --out "$OUT" --resume DIR   # there, a second call: what the first did not finish
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
importable (``pip install --no-index --no-deps --target``), then runs the steps below, each a
child process **in a process group of its own**, ended whole (SIGTERM, then SIGKILL) at its limit
and again when it returns, so nothing a step started outlives it. A step's limit is its planned
seconds (:data:`PLAN`) plus what the steps before it left unused, all within ``--budget-s``
(default 510 s: the call ends inside 9 minutes). ``gpu_session.json`` under ``--out`` is rewritten
after every step: the machine's facts, each step's status (ok, failed, timed out, skipped, done
earlier), seconds, limit, exit status, stdout and stderr tails, its cases and case errors, and the
processes left running (none). Every bench writes its JSON **case by case** (``bench/cases.py``),
so a step cut off at its limit still returns every case it finished, and a case that raises is
recorded with its error while the next case runs. At most 8 files come back, none in a folder
(:func:`return_problems` checks the device tool's limits). This process never imports torch: the
GPU's facts (name, memory, torch, CUDA and cuDNN versions, the TF32 settings) come from a child.

The steps, most valuable first:

0. ``machine``: the app imports without Ray, and the machine's facts (``gpu_session.json``);
1. ``cuda_tests``: ``pytest -m cuda tests/test_cuda.py`` (each test's outcome written as it ends,
   ``bench/pytest_cases.py``: ``cuda_tests.json``): the in-process engine on the GPU, memory,
   out-of-memory advice, and the vectorized path's equality on CUDA with TF32 off (BatchNorm's
   statistics, dropout's masks, the losses read once per call);
2. ``e2e``: ``bench/e2e_overhead.py --workload papers --runners plain local vectorized`` with
   ``training.device=<device>``: FedAvg, FedMR and FedCross in process, one client at a time and
   vectorized, beside the plain loop on the same GPU (``e2e.json``);
3. ``vectorized``: ``bench/vectorized_throughput.py``: clients per second one at a time against
   as one computation, lenet, cnn and resnet20, K = 10 and 100, batch 10 and 50, with GPU memory
   per client (``vectorized_throughput.json``);
4. ``cifar_round``: the same for a round of the papers' CIFAR-10 shape (10 clients of 500 images,
   5 epochs, batch 50; lenet and resnet20) and 2,000 rounds of it projected (``cifar_round.json``);
5. ``throughput``: ``bench/gpu_throughput.py``: 1, 2, 4, 8 client processes sharing the GPU
   (``gpu_throughput.json``).

``--resume DIR`` (the output folder of an earlier call, carried in the working tree): its files
are copied into ``--out``, its steps that ended ok are kept, not run again (their planned seconds
roll over), and a step it did not finish (cut off, failed or skipped) runs again with its bench's
``--resume``: the cases its file holds are kept, the others run (the CUDA tests: those that did
not pass or skip; ``e2e``: a strategy whose runners did not all finish runs whole again). Each
call writes its scratch (the steps' logs, the ``e2e`` runs) in a fresh folder beside ``--site``
(``scratch`` in ``gpu_session.json``): the half-finished runs of a step cut off inside its work
never stand where a later call writes, and an earlier call's stay as they were. ``--steps`` runs
some steps only; ``--limit STEP=S`` changes a step's plan; ``--fault STEP=SPEC`` plants a fault
(``bench/cases.py``; the tests). ``--quick`` shrinks every step to a smoke run (the dry run on
the CPU, tests/test_gpu_session.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import FAULT_VARIABLE, write_json  # noqa: E402 - bench/cases.py

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
    """The children's environment: the installed wheels (when any), the repository and bench/
    (``pytest_cases``, the CUDA tests' case log) importable."""
    paths = [str(site)] if site is not None else []
    paths += [str(REPO), str(REPO / "bench")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1", "FLWR_TELEMETRY_ENABLED": "0",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop(FAULT_VARIABLE, None)  # planted per step (--fault), never inherited
    return env


def install_wheels(target: Path) -> Path | None:
    """Install ``.whl/*.whl`` into ``target`` when this Python cannot import Flower; the folder
    (None when nothing was needed). Checked in a child: this process never imports the app."""
    probe = subprocess.run([sys.executable, "-c", "import flwr, hydra"], capture_output=True)
    if probe.returncode == 0:
        return None
    wheels = sorted(str(w) for w in WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu_session: flwr is not importable and there are no wheels in {WHEELS} "
                         "(run `python bench/gpu_session.py wheels` here first and carry .whl)")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *wheels], check=True)
    return target


#: The child that checks the app imports (without Ray) and reports the machine: this process never
#: touches CUDA, so no memory of the device is held by it during the steps.
MACHINE_SCRIPT = """
import importlib.metadata as metadata, json, os, platform, sys
import launch.cli, server_app.runner, client_app.client_app, fedmm.local_engine
assert 'ray' not in sys.modules, 'ray was imported'
import torch
facts = {'python': platform.python_version(), 'platform': platform.platform(), 'cpus': os.cpu_count(),
         'torch': torch.__version__, 'cuda': torch.version.cuda, 'cuda_available': torch.cuda.is_available()}
for name in ('flwr', 'hydra-core', 'numpy', 'torchvision'):
    try:
        facts[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        facts[name] = None
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    facts.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                 compute_capability=f'{props.major}.{props.minor}', cudnn=torch.backends.cudnn.version())
# TF32: float32 matrix products and convolutions may round their inputs to 10 bits (Ampere and later)
tf32 = {'float32_matmul_precision': torch.get_float32_matmul_precision()}
for label, get in (('matmul_allow_tf32', lambda: torch.backends.cuda.matmul.allow_tf32),
                   ('cudnn_allow_tf32', lambda: torch.backends.cudnn.allow_tf32),
                   ('matmul_fp32_precision', lambda: torch.backends.cuda.matmul.fp32_precision),
                   ('cudnn_conv_fp32_precision', lambda: torch.backends.cudnn.conv.fp32_precision)):
    try:
        tf32[label] = get()
    except Exception:
        tf32[label] = None
facts['tf32'] = tf32
print('MACHINE ' + json.dumps(facts))
"""

#: What may come back from the GPU machine's output folder (the device tool's limits).
RETURN_FILES, RETURN_FILE_MIB, RETURN_TOTAL_MIB, RETURN_DEPTH = 8, 16, 64, 2
RETURN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def return_problems(out: Path) -> list[str]:
    """What in ``out`` would not come back from the GPU machine (empty: everything does)."""
    files = sorted(p for p in out.rglob("*") if p.is_file())
    problems = []
    if len(files) > RETURN_FILES:
        problems.append(f"{len(files)} files, more than {RETURN_FILES}: {[str(f.relative_to(out)) for f in files]}")
    total = 0
    for f in files:
        rel = f.relative_to(out)
        size = f.stat().st_size
        total += size
        if size > RETURN_FILE_MIB * 2**20:
            problems.append(f"{rel}: {size / 2**20:.1f} MiB, more than {RETURN_FILE_MIB}")
        if len(rel.parts) - 1 > RETURN_DEPTH:
            problems.append(f"{rel}: more than {RETURN_DEPTH} folders down")
        if not all(RETURN_NAME.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name with characters other than letters, digits, '.', '_' and '-'")
    if total > RETURN_TOTAL_MIB * 2**20:
        problems.append(f"{total / 2**20:.1f} MiB in all, more than {RETURN_TOTAL_MIB}")
    return problems


def group_members(group: int) -> list[int]:
    """The live processes (zombies left out) of process group ``group``."""
    members = []
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: ask the kernel whether the group has anyone
        try:
            os.killpg(group, 0)
            return [group]
        except (ProcessLookupError, PermissionError):
            return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == group:
            members.append(int(entry.name))
    return members


def end_group(group: int, grace_s: float = 3.0) -> list[int]:
    """End every process of ``group`` (SIGTERM, then SIGKILL after ``grace_s``); the members
    still alive afterwards (empty: none)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not group_members(group):
            return []
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return []
        deadline = time.monotonic() + wait
        while group_members(group) and time.monotonic() < deadline:
            time.sleep(0.05)
    return group_members(group)


def tail(path: Path, chars: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class Session:
    """The steps of one call, each a child process in a process group of its own with a time
    limit, all within a budget: a step's limit is its planned seconds plus what the steps before
    it left unused; at its limit the whole group is ended, and so is anything a step leaves behind."""

    def __init__(self, out: Path, budget_s: float, env: dict[str, str], record: dict[str, Any], logs: Path) -> None:
        self.out, self.env, self.record, self.logs = out, env, record, logs
        self.deadline = time.monotonic() + budget_s
        self.bank = 0.0  # seconds earlier steps left unused
        record.setdefault("steps", [])
        logs.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        write_json(self.out / "gpu_session.json", self.record)

    def carry(self, planned_s: float) -> None:
        """A step that does not run (done by an earlier call) leaves its planned seconds to the next."""
        self.bank += planned_s

    def step(self, name: str, cmd: list[str], planned_s: float, env: dict[str, str] | None = None,
             out_file: str | None = None) -> dict[str, Any]:
        left = self.deadline - time.monotonic()
        entry: dict[str, Any] = {"step": name, "command": " ".join(cmd[1:]), "planned_s": planned_s,
                                 "rolled_over_s": round(self.bank, 1)}
        if left < 10:
            entry.update(status="skipped", reason="the session's time budget is spent")
            self.record["steps"].append(entry)
            self.save()
            return entry
        limit = min(planned_s + self.bank, left)
        start = time.monotonic()
        stdout, stderr = self.logs / f"{name}.out", self.logs / f"{name}.err"
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env or self.env, stdout=out, stderr=err, start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                end_group(proc.pid)
                proc.wait()
                code = 124
            left_running = end_group(proc.pid)  # whatever the step started and left behind
        seconds = time.monotonic() - start
        self.bank = max(0.0, limit - seconds)
        entry.update(exit=code, seconds=round(seconds, 1), limit_s=round(limit, 1), process_group=proc.pid,
                     left_running=left_running, stdout_tail=tail(stdout), stderr_tail=tail(stderr))
        for stray in self.out.glob("*.tmp"):  # a case log cut off while writing: its last whole file stands
            stray.unlink()
        errors = None
        if out_file and (self.out / out_file).is_file():
            try:
                cases = json.loads((self.out / out_file).read_text(encoding="utf-8"))
                errors = len(cases.get("errors", []))
                entry.update(file=out_file, cases=len(cases.get("rows", [])), case_errors=errors,
                             cases_from_earlier_call=cases.get("rows_from_earlier_run", 0))
            except (OSError, ValueError) as bad:
                entry.update(file=out_file, file_error=str(bad))
        entry["status"] = ("timed out" if timed_out else "failed" if code != 0 or errors else "ok")
        self.record["steps"].append(entry)
        self.save()
        print(f"gpu_session: {name}: {entry['status']} in {entry['seconds']} s (limit {entry['limit_s']} s)", flush=True)
        return entry


#: The steps, most valuable first, with their planned seconds: the quick dry run's measured seconds
#: (what a GPU does not shorten: process starts, imports, data, set-up; 2.4, 3.7, 8.3 per process,
#: 4.6, 5.8 and 5.2 s on a 2-core CPU) plus the GPU work estimated from each step's SGD steps at
#: the launch-bound 1-6 ms a step of these small models, times a margin of 1.5 to 4 (the large
#: margins on the steps that matter most; docs/gpu.md, 'Measuring on a lent GPU', has the table). Unused
#: seconds roll over, and ``--resume`` finishes what a tight plan leaves.
PLAN: dict[str, float] = {"machine": 20, "cuda_tests": 90, "e2e": 170, "vectorized": 90, "cifar_round": 60, "throughput": 50}
#: Each step's JSON under --out (the machine's facts go into gpu_session.json itself).
FILES = {"cuda_tests": "cuda_tests.json", "e2e": "e2e.json", "vectorized": "vectorized_throughput.json",
         "cifar_round": "cifar_round.json", "throughput": "gpu_throughput.json"}


def step_commands(args: argparse.Namespace, out: Path, resume: dict[str, bool], scratch: Path) -> dict[str, list[str]]:
    """Each bench step's command (``resume[step]``: keep the cases an earlier call finished;
    ``scratch``: this call's folder, :func:`call_folder`)."""
    py = sys.executable
    again = lambda step: ["--resume"] if resume.get(step) else []  # noqa: E731
    cuda_tests = [py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-p", "pytest_cases", "tests/test_cuda.py"]
    e2e = [py, "bench/e2e_overhead.py", "--workload", "papers", "--runners", "plain", "local", "vectorized", "--rounds",
           str(args.rounds), "--strategies", *args.strategies, "--override", f"training.device={args.device}", "--workdir",
           str(scratch / "e2e-runs"), "--out", str(out / FILES["e2e"]), *again("e2e")]
    if args.quick:
        e2e += ["--clients-per-round", "2", "--local-epochs", "1"]  # the papers' 100 clients (40 images each), 2 per round
    vectorized = [py, "bench/vectorized_throughput.py", "--device", args.device, "--out", str(out / FILES["vectorized"]),
                  *again("vectorized")]
    vectorized += (["--models", "lenet", "--clients", "2", "3", "--batch-sizes", "10", "--repeats", "1"] if args.quick
                   else ["--repeats", "2"])
    cifar = [py, "bench/vectorized_throughput.py", "--device", args.device, "--models", "lenet", "resnet20", "--shape", "cifar",
             "--batch-sizes", "50", "--projected-rounds", "2000", "--out", str(out / FILES["cifar_round"]), *again("cifar_round")]
    cifar += (["--clients", "2", "--samples-per-client", "60", "--epochs", "1", "--repeats", "1"] if args.quick
              else ["--clients", "10", "--samples-per-client", "500", "--epochs", "5", "--repeats", "2"])
    throughput = [py, "bench/gpu_throughput.py", "--device", args.device, "--out", str(out / FILES["throughput"]),
                  *again("throughput")]
    throughput += (["--models", "cnn", "--clients", "1", "--samples-per-client", "50", "--repeats", "1"] if args.quick
                   else ["--clients", "1", "2", "4", "8", "--repeats", "3"])
    return {"cuda_tests": cuda_tests, "e2e": e2e, "vectorized": vectorized, "cifar_round": cifar, "throughput": throughput}


def earlier_call(resume: Path, out: Path) -> dict[str, Any]:
    """The record of the call ``resume`` holds, its files copied into ``out``."""
    record_file = resume / "gpu_session.json"
    if not record_file.is_file():
        raise SystemExit(f"gpu_session: --resume {resume}: no gpu_session.json there")
    earlier = json.loads(record_file.read_text(encoding="utf-8"))
    if resume.resolve() != out.resolve():
        for f in resume.iterdir():
            if f.is_file() and f.name != "gpu_session.json" and not f.name.endswith(".tmp"):
                shutil.copyfile(f, out / f.name)
    return earlier


def call_folder(site: Path) -> Path:
    """A fresh folder beside ``site`` for this call's scratch (its steps' logs, the e2e runs): a
    step cut off inside its work leaves its half-finished runs in its own call's folder only."""
    site.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("call-%Y%m%d-%H%M%S-"), dir=site.parent))


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    limits = dict(PLAN)
    for item in args.limit:
        name, _, value = item.partition("=")
        if name not in PLAN:
            raise SystemExit(f"gpu_session: --limit {item}: the steps are {', '.join(PLAN)}")
        limits[name] = float(value)
    faults: dict[str, str] = {}
    for item in args.fault:
        name, _, spec = item.partition("=")
        if name not in FILES:
            raise SystemExit(f"gpu_session: --fault {item}: the bench steps are {', '.join(FILES)}")
        faults[name] = spec
    chosen = args.steps or list(FILES)
    unknown = sorted(set(chosen) - set(FILES))
    if unknown:
        raise SystemExit(f"gpu_session: --steps {' '.join(unknown)}: the bench steps are {', '.join(FILES)}")
    earlier = earlier_call(Path(args.resume), out) if args.resume else None
    done_before = {s["step"]: s for s in (earlier or {}).get("steps", []) if s.get("status") in ("ok", "done earlier")}
    site = install_wheels(Path(args.site))
    env = child_env(site)
    scratch = call_folder(Path(args.site))
    record: dict[str, Any] = {"argv": sys.argv[1:], "wheels_installed": site is not None, "plan_s": limits,
                              "budget_s": args.budget_s, "scratch": str(scratch)}
    if earlier is not None:
        record["earlier_calls"] = earlier.get("earlier_calls", []) + [{k: v for k, v in earlier.items() if k != "earlier_calls"}]
    session = Session(out, args.budget_s - (time.monotonic() - started), env, record, scratch / "logs")
    session.save()
    machine = session.step("machine", [sys.executable, "-c", MACHINE_SCRIPT], limits["machine"])
    facts = [line[len("MACHINE "):] for line in machine.get("stdout_tail", "").splitlines() if line.startswith("MACHINE ")]
    record["machine"] = dict(json.loads(facts[-1]) if facts else {}, device=args.device)
    session.save()
    if machine["status"] != "ok":
        return 1
    resume = {name: earlier is not None and name not in done_before for name in FILES}
    commands = step_commands(args, out, resume, scratch)
    for name in FILES:
        if name not in chosen:
            continue
        if name in done_before:
            prior = done_before[name]
            record["steps"].append({"step": name, "status": "done earlier", "seconds": prior.get("seconds"),
                                    "file": FILES[name], "cases": prior.get("cases")})
            session.carry(limits[name])
            session.save()
            continue
        step_env = dict(env)
        if name in faults:
            step_env[FAULT_VARIABLE] = faults[name]
        cmd = commands[name]
        if name == "cuda_tests":
            step_env["FEDMM_CASES_JSON"] = str(out / FILES[name])
            if resume[name] and (out / FILES[name]).is_file():  # the tests an earlier call ran to the end stay done
                step_env["FEDMM_CASES_RESUME"] = "1"
                kept = json.loads((out / FILES[name]).read_text(encoding="utf-8")).get("rows", [])
                cmd = cmd + [arg for row in kept if row["outcome"] != "failed" for arg in ("--deselect", row["test"])]
        session.step(name, cmd, limits[name], step_env, FILES[name])
    record["seconds"] = round(time.monotonic() - started, 1)
    record["parent_imported_torch"] = "torch" in sys.modules
    record["return_problems"] = return_problems(out)
    session.save()
    steps = [s for s in record["steps"] if s["step"] in chosen or s["step"] == "machine"]
    return 0 if all(s["status"] in ("ok", "done earlier") for s in steps) and not record["return_problems"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    wheels = sub.add_parser("wheels", help="here: download the wheels the GPU machine lacks into .whl/")
    wheels.add_argument("--list", action="store_true", help="print the plan, download nothing")
    wheels.add_argument("--budget-mib", type=float, default=48.0, help="the most the wheels may take (they travel with the tree)")
    there = sub.add_parser("run", help="there: install the wheels, then the steps, each finished case saved as it ends")
    there.add_argument("--out", required=True, help="where the JSON results go ($OUT on the GPU machine)")
    there.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    there.add_argument("--rounds", type=int, default=10)
    there.add_argument("--strategies", nargs="+", default=["fedavg", "fedmr", "fedcross"])
    there.add_argument("--quick", action="store_true", help="smoke-sized steps (the dry run)")
    there.add_argument("--budget-s", type=float, default=510.0, help="seconds for the whole call")
    there.add_argument("--resume", metavar="DIR", default=None,
                       help="the output folder of an earlier call: its finished steps are not run again, its files are "
                            "copied into --out and a step it did not finish keeps the cases it did")
    there.add_argument("--steps", nargs="+", default=None, metavar="STEP",
                       help=f"run only these bench steps (in the plan's order; default: all of {', '.join(FILES)})")
    there.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS",
                       help="a step's planned seconds in place of the plan's")
    there.add_argument("--fault", action="append", default=[], metavar="STEP=SPEC",
                       help=f"plant a fault in a step (tests): {FAULT_VARIABLE}=SPEC for that step, e.g. vectorized=raise@1")
    there.add_argument("--site", default="/tmp/fedmm-gpu/site",
                       help="where the wheels are installed (each call's logs and e2e runs in a fresh folder beside it)")
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

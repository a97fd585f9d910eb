"""This user's local SuperLink: its ports, and stopping it.

``flwr run`` starts a local SuperLink on 127.0.0.1:39091 (Control API 39093) and joins any
SuperLink already listening there, whoever started it and whatever Python environment it runs
in. Deriving the two ports from the user id keeps users of one machine apart:

    eval "$(python -m fedmm.superlink env)"    # FLWR_LOCAL_SUPERLINK_HTTP_API_PORT / _CONTROL_API_PORT
    python -m fedmm.superlink status           # is this user's local SuperLink running? (pid, ports)
    python -m fedmm.superlink stop             # stop it (by PID; only a SuperLink of this user)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

#: Flower's defaults; user ids shift both.
BASE_HTTP_PORT = 39091
BASE_CONTROL_PORT = 39093


def user_ports(uid: int | None = None) -> tuple[int, int]:
    """(SuperLink HTTP API port, Control API port) of a user: Flower's defaults for root, a
    distinct pair in 40000..59999 for every other uid below 10,000 (3 ports apart)."""
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return BASE_HTTP_PORT, BASE_CONTROL_PORT
    http = 40000 + (uid % 10000) * 2
    return http, http + 1


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def local_superlinks(port: int, uid: int | None = None) -> list[int]:
    """PIDs of this user's ``flower-superlink`` processes serving ``--port <port>``."""
    uid = os.getuid() if uid is None else uid
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        args = _cmdline(int(proc.name))
        if not any(a.endswith("flower-superlink") for a in args[:2]):
            continue
        try:
            owner = proc.stat().st_uid
        except OSError:
            continue
        if owner == uid and "--port" in args and args[args.index("--port") + 1 : args.index("--port") + 2] == [str(port)]:
            pids.append(int(proc.name))
    return pids


def stop(port: int, timeout: float = 15.0) -> list[int]:
    """SIGTERM (then SIGKILL after ``timeout``) to this user's SuperLink on ``port``; the PIDs."""
    pids = local_superlinks(port)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    return pids


def _alive(pid: int) -> bool:
    """Running (an exited process waiting for its parent to reap it does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("env", "status", "stop"))
    args = parser.parse_args(argv)
    http, control = user_ports()
    http = int(os.environ.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", http))
    control = int(os.environ.get("FLWR_LOCAL_CONTROL_API_PORT", control))
    if args.command == "env":
        print(f"export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT={http} FLWR_LOCAL_CONTROL_API_PORT={control}")
        return 0
    if args.command == "status":
        pids = local_superlinks(http)
        print(f"local SuperLink on 127.0.0.1:{http}: " + (f"running (pid {', '.join(map(str, pids))})" if pids else "not running"))
        return 0
    pids = stop(http)
    print(f"stopped the local SuperLink on 127.0.0.1:{http} (pid {', '.join(map(str, pids))})" if pids
          else f"no local SuperLink of this user on 127.0.0.1:{http}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

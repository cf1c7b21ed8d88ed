"""A real one-node Slurm on this machine, for tests/slurm and CI: ``python3 -m tests.slurm.cluster``.

Installs Debian's ``slurm-wlm`` and ``munge`` where missing (``apt-get update`` once, then
``apt-get install -y slurm-wlm munge``), makes a munge key where there is none, starts munged, writes a
minimal ``/etc/slurm/slurm.conf`` (this host only, CPUs only, slurmctld and slurmd as root, state under
``STATE_DIR``), starts slurmctld and slurmd and waits until ``sinfo`` shows the node idle. A second call
finds it running and returns at once. Standard library only: ``.ci/run`` calls it with the system
python3, before the venv exists.

Needs root and a working apt (skipped, loudly, by tests/slurm otherwise; failed with REQUIRE_SLURM=1).
Settings seen working with slurm-wlm 22.05 (bookworm): ``ProctrackType=proctrack/linuxproc``,
``TaskPlugin=task/none`` (no cgroups needed, so it runs in a container), ``SelectType=select/cons_tres``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

SLURM_CONF = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
STATE_DIR = Path("/var/spool/ddp-lab-slurm")
MARK = "# written by ddp-lab's tests/slurm/cluster.py"
PARTITION = "ddplab"
COMMANDS = ("sbatch", "sinfo", "scontrol", "scancel", "slurmctld", "slurmd", "munged", "munge")
READY_STATES = ("idle", "mixed", "allocated", "completing")  # the node answers and takes jobs
START_TIMEOUT_S = 90.0


class Unavailable(RuntimeError):
    """Slurm cannot be installed here (not root, no usable apt): a reason to skip, not a failure."""


class ClusterError(RuntimeError):
    """Slurm was installed but does not come up: always a failure."""


def _run(command: list[str], timeout: float = 60, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise ClusterError(
            f"{' '.join(command)} exited {result.returncode}: {(result.stderr or result.stdout).strip()[-800:]}"
        )
    return result


def _sbin(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin") or name


def hostname() -> str:
    """The node's name, as `hostname -s` prints it (what slurmd registers as)."""
    return socket.gethostname().split(".")[0]


def node_state() -> str | None:
    """'idle', 'down*', ... as sinfo prints this node's state, or None when slurmctld does not answer."""
    if shutil.which("sinfo") is None:
        return None
    try:
        result = _run(["sinfo", "--noheader", "--nodes", hostname(), "--format=%T"], timeout=15)
    except subprocess.TimeoutExpired:
        return None
    lines = result.stdout.split()
    return lines[0] if result.returncode == 0 and lines else None


def is_running() -> bool:
    """Slurm answers and this node takes jobs (munge too: every command needs it)."""
    if any(shutil.which(c) is None and shutil.which(c, path="/usr/sbin") is None for c in COMMANDS):
        return False
    return _munge_works() and (node_state() or "").rstrip("*~#!%$@^-") in READY_STATES


def _check_can_install() -> None:
    if os.geteuid() != 0:
        raise Unavailable("not root: installing and starting Slurm (slurmctld, slurmd, munged) needs root")
    if shutil.which("apt-get") is None:
        raise Unavailable("apt-get is not available: install slurm-wlm and munge yourself")


def install() -> None:
    """apt-get update once, then install slurm-wlm and munge; nothing when every command is there."""
    missing = [c for c in COMMANDS if shutil.which(c) is None and shutil.which(c, path="/usr/sbin") is None]
    if not missing:
        return
    _check_can_install()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"slurm: installing slurm-wlm and munge (missing: {', '.join(missing)})", file=sys.stderr, flush=True)
    update = _run(["apt-get", "update", "-qq"], timeout=600, env=env)
    if update.returncode != 0:
        raise Unavailable(f"apt-get update failed: {(update.stderr or update.stdout).strip()[-400:]}")
    installed = _run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"], timeout=1200, env=env
    )
    if installed.returncode != 0:
        raise Unavailable(
            f"apt-get install slurm-wlm munge failed: {(installed.stderr or installed.stdout).strip()[-400:]}"
        )


def _munge_works() -> bool:
    if shutil.which("munge") is None or shutil.which("unmunge") is None:
        return False
    encoded = _run(["munge", "-n"], timeout=10)
    return encoded.returncode == 0 and _run(["unmunge"], timeout=10, input=encoded.stdout).returncode == 0


def _process_running(name: str) -> bool:
    """A process of that name, read from /proc (pgrep is not on every minimal image)."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == name:
                return True
        except OSError:
            continue
    return False


def start_munge() -> None:
    """A key (1 KiB of random bytes, munge:munge 0400) if none, then munged as user munge."""
    if _munge_works():
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    for folder in (Path("/run/munge"), Path("/var/lib/munge"), Path("/var/log/munge")):
        folder.mkdir(parents=True, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    # A socket left by a munged that is gone makes the new one refuse to start.
    if not _process_running("munged"):
        for stale in Path("/run/munge").glob("munge.socket.2*"):
            stale.unlink()
    _run(["runuser", "-u", "munge", "--", _sbin("munged")], timeout=30, check=True)
    deadline = time.monotonic() + 20
    while not _munge_works():
        if time.monotonic() > deadline:
            raise ClusterError("munged started but `munge -n | unmunge` still fails (see /var/log/munge/munged.log)")
        time.sleep(0.2)


def slurm_conf(host: str, cpus: int) -> str:
    return f"""{MARK}: one node, CPUs only, for tests/slurm
ClusterName=ddplab
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again: 120 by default, 10 here to keep the
# tests short (real clusters keep their own).
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
StateSaveLocation={STATE_DIR}/slurmctld
SlurmdSpoolDir={STATE_DIR}/slurmd
SlurmctldPidFile={STATE_DIR}/slurmctld.pid
SlurmdPidFile={STATE_DIR}/slurmd.pid
SlurmctldLogFile={STATE_DIR}/slurmctld.log
SlurmdLogFile={STATE_DIR}/slurmd.log
NodeName={host} NodeAddr={_address(host)} CPUs={cpus} State=UNKNOWN
PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _address(host: str) -> str:
    """The host's own address if its name resolves, else loopback (one node: slurmd and slurmctld on it)."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def conf_is_current() -> bool:
    """slurm.conf is ours as this file writes it today, or someone else's (then left alone)."""
    if not SLURM_CONF.exists():
        return False
    text = SLURM_CONF.read_text()
    return MARK not in text or text == slurm_conf(hostname(), os.cpu_count() or 1)


def write_conf() -> None:
    """Ours, written unless a slurm.conf that is not ours is already there, or ours is current."""
    if conf_is_current():
        return
    text = slurm_conf(hostname(), os.cpu_count() or 1)
    SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
    SLURM_CONF.write_text(text)
    for daemon in ("slurmctld", "slurmd"):  # a daemon running with an older file: restart it below
        pid = _pid_of(daemon)
        if pid is not None:
            os.kill(pid, 15)
            _wait_gone(pid)


def _pid_of(daemon: str) -> int | None:
    pid_file = STATE_DIR / f"{daemon}.pid"
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    return pid


def _wait_gone(pid: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(0.2)


def start_daemons() -> None:
    for folder in ("slurmctld", "slurmd"):
        (STATE_DIR / folder).mkdir(parents=True, exist_ok=True)
    # slurmctld first: slurmd registers with it. Both fork into the background themselves.
    if _pid_of("slurmctld") is None:
        _run([_sbin("slurmctld")], timeout=60, check=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while _run(["scontrol", "ping"], timeout=15).stdout.count("UP") == 0:
        if time.monotonic() > deadline:
            raise ClusterError(
                f"slurmctld does not answer `scontrol ping` after {START_TIMEOUT_S:g} s (see {STATE_DIR}/slurmctld.log)"
            )
        time.sleep(0.5)
    if _pid_of("slurmd") is None:
        _run([_sbin("slurmd")], timeout=60, check=True)


def wait_idle(timeout: float = START_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    resumed = False
    while True:
        state = node_state() or "unknown"
        if state.rstrip("*~#!%$@^-") in READY_STATES:
            return state
        if not resumed and state.startswith(("down", "drain")) and not state.endswith("*"):
            # slurmd answers, but an earlier run left the node down or drained: take it back
            _run(["scontrol", "update", f"nodename={hostname()}", "state=resume"], timeout=15)
            resumed = True
        if time.monotonic() > deadline:
            raise ClusterError(
                f"node {hostname()} is {state!r} in sinfo after {timeout:g} s, not idle "
                f"(see {STATE_DIR}/slurmd.log and slurmctld.log)"
            )
        time.sleep(0.5)


def ensure_running() -> str:
    """Install, configure and start Slurm unless it already runs; the one-line state it is in."""
    if is_running() and conf_is_current():
        return f"slurm: already running; node {hostname()} is {node_state()}"
    install()
    _check_can_install()  # starting daemons needs root as much as installing does
    start_munge()
    write_conf()
    start_daemons()
    state = wait_idle()
    version = _run(["sinfo", "--version"], timeout=15).stdout.strip()
    return f"slurm: {version} running; node {hostname()} ({os.cpu_count()} CPUs) is {state}"


def main() -> int:
    try:
        print(ensure_running(), flush=True)
    except Unavailable as why:
        print(f"slurm: cannot install here: {why}", file=sys.stderr)
        return 2
    except (ClusterError, subprocess.TimeoutExpired) as error:
        print(f"error: slurm: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A Flower deployment on this machine: ``silodp federation up`` / ``down`` and runs on it.

``up`` writes a federation directory (default ``.silodp-federation``) with a certificate
authority and the SuperLink's TLS certificate (for 127.0.0.1), one authentication key pair per
SuperNode (registered with the SuperLink through its Control API), each silo's data file and
secret, and starts one SuperLink and one SuperNode per silo, every one bound to 127.0.0.1 and
in its own process session; ``down`` stops them by their recorded PIDs (process groups).
:func:`submit` runs an experiment on it with ``flwr run``: the ServerApp runs the experiment
in the SuperLink's ServerApp process and writes the results where this machine can read them.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from silodp.config import load_config
from silodp.data.build import build_federated_data
from silodp.engines.factory import check_engine_config, write_silo_files
from silodp.engines.silo import silo_file
from silodp.errors import InvalidValueError, SilodpError

__all__ = ["DEFAULT_DIR", "descendants", "down", "stop_processes", "submit", "up"]

DEFAULT_DIR = Path(".silodp-federation")
STATE = "federation.json"
CONNECTION = "silodp"
APP_DIR = Path(__file__).parent / "app"


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
            "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def _private_dir(path: Path) -> Path:
    """``path`` as a directory only this user may enter (the silos' records, the keys)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _certificates(pki: Path) -> None:
    """A CA and the SuperLink's certificate for 127.0.0.1/localhost (for trying it out)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    _private_dir(pki)
    now = dt.datetime.now(dt.UTC)
    life = dt.timedelta(days=30)

    def key_pem(key: Any) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "silodp federation CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + life)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + life)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (pki / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_private(pki / "ca.key", key_pem(ca_key))
    (pki / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(pki / "server.key", key_pem(key))


def _node_key(keys: Path, silo: int) -> Path:
    """A SuperNode's authentication key pair (EC P-384, OpenSSH format)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    _private_dir(keys)
    k = ec.generate_private_key(ec.SECP384R1())
    private = keys / f"silo-{silo}"
    _write_private(
        private,
        k.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
    )
    public = k.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    (keys / f"silo-{silo}.pub").write_bytes(public + f" silo-{silo}\n".encode())
    return private


def _spawn(
    state: dict[str, Any], name: str, cmd: list[str], env: dict[str, str], logs: Path
) -> None:
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as log:
        p = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    state["processes"][name] = p.pid
    # with the PID, when the process started: a PID reused later is not this process
    state.setdefault("started", {})[name] = _start_time(p.pid)


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the process name (which may hold any bytes)."""
    text = Path(f"/proc/{pid}/stat").read_bytes().decode("utf-8", "replace")
    return text.rsplit(")", 1)[1].split()


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc``); ``None`` if none runs."""
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def _save(directory: Path, state: dict[str, Any]) -> None:
    (directory / STATE).write_text(json.dumps(state, indent=1), encoding="utf-8")


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SilodpError(f"The SuperLink did not listen on 127.0.0.1:{port} within {timeout:g} s.")


def _flwr(args: list[str], home: Path, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_bin("flwr"), *args], env=_env(home), capture_output=True, text=True, timeout=timeout
    )


def up(
    config_path: str | Path,
    *,
    directory: str | Path = DEFAULT_DIR,
    silos: int | None = None,
    log: Callable[[str], None] = print,
    wait: float = 120.0,
) -> dict[str, Any]:
    """Starts a SuperLink and one SuperNode per silo of ``config_path``'s data on 127.0.0.1,
    with TLS and SuperNode authentication; returns the federation's state (also written to
    ``directory/federation.json``).

    Raises:
      InvalidValueError: a federation is already up in ``directory``, or ``silos`` (the
        SuperNodes asked for) is not the number of silos of the config's data.
    """
    d = Path(directory).resolve()
    if (d / STATE).is_file() and _alive_pids(json.loads((d / STATE).read_text(encoding="utf-8"))):
        raise InvalidValueError(
            f"Expected no federation running in {str(d)!r}; stop it with silodp federation down."
        )
    config = load_config(config_path)
    check_engine_config(config)
    data = build_federated_data(config.data)
    if silos is not None and silos != data.train.num_silos:
        raise InvalidValueError(
            f"Expected --silos {silos} to match the {data.train.num_silos} silos of the data of "
            f"{str(config_path)!r}: one SuperNode serves one silo."
        )
    silos = data.train.num_silos
    d.mkdir(parents=True, exist_ok=True)
    # every silo's raw records (each SuperNode reads its own): readable by this user only
    write_silo_files(data.train, _private_dir(d / "silos"))
    _certificates(d / "pki")
    port = _free_port()
    home = d / "home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "127.0.0.1:{port}"\nroot-certificates = "{d / "pki" / "ca.crt"}"\n',
        encoding="utf-8",  # TOML is UTF-8, whatever the locale
    )
    state: dict[str, Any] = {
        "port": port,
        "silos": silos,
        "processes": {},
        "config": str(Path(config_path).resolve()),
    }
    logs = d / "logs"
    _spawn(
        state,
        "superlink",
        [
            _bin("flower-superlink"),
            "--ssl-ca-certfile",
            str(d / "pki" / "ca.crt"),
            "--ssl-certfile",
            str(d / "pki" / "server.pem"),
            "--ssl-keyfile",
            str(d / "pki" / "server.key"),
            "--enable-supernode-auth",
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        _env(d / "home-superlink"),
        logs,
    )
    _save(d, state)
    _wait_port(port, 60.0)
    log(f"SuperLink on 127.0.0.1:{port} (TLS, SuperNode authentication)")
    for s in range(silos):
        private = _node_key(d / "keys", s)
        done = _flwr(
            [
                "supernode",
                "register",
                f"{private}.pub",
                CONNECTION,
                "--name",
                f"silo-{s}",
                "--format",
                "json",
            ],
            home,
        )
        if done.returncode != 0:
            raise SilodpError(
                f"Registering silo {s}'s SuperNode key failed: {done.stdout}{done.stderr}"
            )
        data_path = silo_file(d / "silos", s)
        _spawn(
            state,
            f"supernode-{s}",
            [
                _bin("flower-supernode"),
                "--superlink",
                f"127.0.0.1:{port}",
                "--root-certificates",
                str(d / "pki" / "ca.crt"),
                "--auth-supernode-private-key",
                str(private),
                "--node-config",
                f"silo={s} data='{data_path}'",
                "--host",
                "127.0.0.1",
                "--port",
                str(_free_port()),
            ],
            _env(d / f"home-silo-{s}"),
            logs,
        )
        _save(d, state)
    log(f"{silos} SuperNodes started, one per silo, each reading its own data file")
    return state


def _alive_pids(state: dict[str, Any]) -> list[int]:
    """The recorded processes still running: a PID that now names a process started at
    another time than the one recorded (the PID was reused) is not counted."""
    alive = []
    started = state.get("started", {})
    for name, pid in state.get("processes", {}).items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        if started.get(name) is not None and _start_time(pid) != started[name]:
            continue
        try:  # a zombie (exited, not yet reaped) is not alive
            if _stat_fields(pid)[0] == "Z":
                continue
        except (OSError, IndexError):
            continue
        alive.append(pid)
    return alive


def descendants(pids: list[int]) -> list[int]:
    """Every live process descending from ``pids`` (from ``/proc``; Flower starts its
    SuperExec and app processes as children, some in sessions of their own)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent[int(entry.name)] = int(_stat_fields(entry.name)[1])
        except (OSError, IndexError):
            continue
    found: list[int] = []
    frontier = set(pids)
    while frontier:
        children = {p for p, pp in parent.items() if pp in frontier and p not in found}
        found.extend(sorted(children))
        frontier = children
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        for kill in (os.killpg, os.kill):  # its group, and itself if it leads none
            try:
                kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def stop_processes(pids: list[int], grace: float = 15.0) -> None:
    """Stops ``pids`` and all their descendants: SIGTERM, then SIGKILL after ``grace`` to those
    still running since before (a PID reused meanwhile by another process is left alone)."""
    every = [*pids, *descendants(pids)]
    snapshot = {
        "processes": {str(i): pid for i, pid in enumerate(every)},
        "started": {str(i): _start_time(pid) for i, pid in enumerate(every)},
    }
    _signal_all(every, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive_pids(snapshot):
        time.sleep(0.2)
    _signal_all(_alive_pids(snapshot), signal.SIGKILL)


def down(*, directory: str | Path = DEFAULT_DIR, log: Callable[[str], None] = print) -> None:
    """Stops every process ``up`` started, by recorded PID, with their descendants."""
    d = Path(directory).resolve()
    if not (d / STATE).is_file():
        log(f"no federation in {d}")
        return
    state = json.loads((d / STATE).read_text(encoding="utf-8"))
    recorded = list(state.get("processes", {}).values())
    pids = _alive_pids(state)  # never a process that merely reuses a recorded PID
    stop_processes(pids)
    state["processes"], state["started"] = {}, {}
    _save(d, state)
    gone = len(recorded) - len(pids)
    log(
        f"stopped {len(pids)} processes of the federation in {d} (and their children)"
        + (f"; {gone} recorded had already ended" if gone else "")
    )


def _every_run_finished(summary_path: Path) -> bool:
    """Whether the experiment summary at ``summary_path`` lists runs that all ended (a resume
    of it has nothing to do, and writes nothing)."""
    from silodp.experiment.run import every_run_finished

    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and every_run_finished(summary)


#: how ``flwr run`` names the run it started
STARTED = re.compile(r"Successfully started run (\d+)")


def _stop_run(run_id: str, directory: Path, out_dir: Path, log: Callable[[str], None]) -> None:
    """Stops run ``run_id`` on the SuperLink (``flwr stop``) and waits (a minute at most)
    for its ServerApp to let go of ``out_dir``: stopping ``flwr run`` alone left it training
    and spending. A round it had begun counts in full (its silos were charged before its
    messages left) and runs again on resume."""
    from silodp import locking
    from silodp.experiment.run import RESULTS_LOCK

    try:
        done = subprocess.run(
            [_bin("flwr"), "stop", run_id, CONNECTION],
            env=_env(directory / "home"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        stopped = done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        stopped = False
    if not stopped:
        log(
            f"could not stop run {run_id} on the federation: it may still be training and "
            f"spending; stop it with: flwr stop {run_id} {CONNECTION} (FLWR_HOME="
            f"{directory / 'home'})"
        )
        return
    log(f"stopped run {run_id} on the federation")
    deadline = time.monotonic() + 60
    lock = str(out_dir.resolve() / RESULTS_LOCK)
    while locking.holder(lock) is not None and time.monotonic() < deadline:
        time.sleep(0.5)


def submit(
    config_path: str | Path,
    out: str | Path,
    *,
    ledger: str | Path | None = None,
    directory: str | Path = DEFAULT_DIR,
    overwrite: bool = False,
    resume: bool = False,
    timeout: float = 600.0,
    on_failure: str = "abort",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs the experiment on the federation ``up`` started, or on the SuperLink named in
    ``directory/home/config.toml`` (``flwr run``, streaming its log); returns the experiment
    summary the ServerApp wrote (where the ServerApp's machine put ``out``). ``ledger``: the
    privacy ledger every run writes through, in place of the config's ``privacy.ledger`` (a
    new run only: a resumed one keeps its own).

    Raises:
      InvalidValueError: a config the Flower engines do not run (before anything is sent),
        ``ledger`` with ``resume``, or no federation in ``directory``.
    """
    if resume and ledger is not None:
        raise InvalidValueError(
            f"Expected no ledger with resume, got {str(ledger)!r}: a resumed run continues "
            "with the ledger it started with."
        )
    if not resume:
        check_engine_config(load_config(config_path))
    d = Path(directory).resolve()
    local = d / STATE
    if local.is_file() and not _alive_pids(json.loads(local.read_text(encoding="utf-8"))):
        raise InvalidValueError(
            f"Expected the federation in {str(d)!r} to be running; its processes have "
            "stopped. Start it again with silodp federation up CONFIG."
        )
    if not (d / "home" / "config.toml").is_file():
        raise InvalidValueError(
            f"Expected a federation in {str(d)!r}: start one with silodp federation up CONFIG, "
            f"or name a SuperLink elsewhere in {str(d / 'home' / 'config.toml')!r} "
            f"([superlink.{CONNECTION}] address and root-certificates)."
        )
    out_dir = Path(out).resolve()
    settings = {
        "config": str(Path(config_path).resolve()),
        # the config's relative ledger and data paths are read from here, as `silodp run`
        # reads them (the ServerApp runs in the directory the federation was started from)
        "workdir": str(Path.cwd()),
        "out": str(out_dir),
        "resume": resume,
        "overwrite": overwrite,
        "timeout": float(timeout),
        "on-failure": on_failure,
        **({"ledger": str(Path(ledger).resolve())} if ledger is not None else {}),
    }
    started = time.time()
    args = ["run", str(APP_DIR), CONNECTION, "--stream"]
    for key, value in settings.items():
        args += ["--run-config", f"{key}={json.dumps(value)}"]
    proc = subprocess.Popen(
        [_bin("flwr"), *args],
        env=_env(d / "home"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    run_id: str | None = None
    try:
        for line in proc.stdout:
            log(line.rstrip())
            found = STARTED.search(line)
            if found and run_id is None:
                run_id = found.group(1)
        proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        if run_id is not None:  # the ServerApp runs on the federation: stop it there too
            _stop_run(run_id, d, out_dir, log)
        else:
            log(
                "stopped before the federation named its run: if it started, list it with "
                f"flwr ls {CONNECTION} and stop it with flwr stop RUN_ID {CONNECTION} "
                f"(FLWR_HOME={d / 'home'})"
            )
        raise
    summary_path = out_dir / "summary.json"
    fresh = summary_path.is_file() and summary_path.stat().st_mtime >= started
    if not fresh and not (resume and _every_run_finished(summary_path)):
        raise SilodpError(
            f"The run on the federation ended without writing {summary_path} (flwr exit "
            f"{proc.returncode}); see the log above and {d / 'logs'}. A run that stopped "
            f"part-way continues from its last completed round with: silodp run --resume "
            f"{out_dir} --engine flower-deploy --federation {d}"
        )
    result: dict[str, Any] = json.loads(summary_path.read_text(encoding="utf-8"))
    return result

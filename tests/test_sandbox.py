"""Sandbox tests: hostile programs, each contained with a clear result and the host unharmed.

Short timeouts (1-3 s) keep the file fast on a 2-core machine. Tests that rely on the per-run
unprivileged uid (only possible as root) or on a network namespace skip, saying why, elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tamer.cli import sandbox_app
from tamer.tools import sandbox
from tamer.tools.sandbox import SandboxConfig, SandboxError, SandboxPool, run_file, run_python

FAST = SandboxConfig(timeout_s=3)
# Programs that would hurt the host if they ran as root refuse to run without the uid drop.
DROPPED = SandboxConfig(timeout_s=3, require=("uid-drop",))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="per-run uid needs root")


def _run_marked(code: str, config: SandboxConfig):
    """Run `code` after it prints the run's marker: every process of that run (and no other run,
    even in a concurrent test session reusing the uid) carries it in its environment."""
    result = run_python("import os\nprint(os.environ['TAMER_SANDBOX'], flush=True)\n" + code, config)
    return result, result.stdout.split("\n", 1)[0]


def _live_processes_marked(marker: str) -> list[int]:
    needle = f"TAMER_SANDBOX={marker}".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (needle in Path("/proc", pid, "environ").read_bytes().split(b"\0")
                    and not Path("/proc", pid, "stat").read_text().rsplit(")", 1)[1].startswith(" Z")):
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def _assert_host_fine(marker: str) -> None:
    """Nothing of the run survives, and the host can still start processes."""
    assert marker and _live_processes_marked(marker) == []
    assert subprocess.run(["true"], check=False).returncode == 0


# ------------------------------------------------------------------------------ config and basics


@pytest.mark.parametrize(
    "kwargs, field",
    [({"timeout_s": 0}, "timeout_s"), ({"memory_mb": 0}, "memory_mb"), ({"network": "open"}, "network"),
     ({"cpu_time_s": -1}, "cpu_time_s"), ({"max_processes": 0}, "max_processes"),
     ({"max_output_bytes": -1}, "max_output_bytes"), ({"require": ("magic",)}, "require")],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**kwargs)


def test_trivial_program_succeeds_with_structured_result():
    result = run_python("print(6 * 7)", FAST)
    assert result.ok and result.exit_code == 0 and result.stdout == "42\n"
    assert result.limit_hit is None and not result.timed_out and result.signal is None
    assert {"new-session", "scrubbed-env", "tmp-workdir", "rlimit_as", "rlimit_cpu"} <= set(result.protections)
    d = result.to_dict()
    assert {"ok", "exit_code", "timed_out", "limit_hit", "stdout", "stderr", "duration_s"} <= set(d)
    json.dumps(d)  # plain JSON types only


def test_failing_program_reports_exit_code_and_stderr():
    result = run_python("import sys\nprint('bad', file=sys.stderr)\nsys.exit(3)", FAST)
    assert not result.ok and result.exit_code == 3 and result.stderr == "bad\n" and result.limit_hit is None


def test_stdin_and_importable_files(tmp_path):
    code = "import helper, sys\nprint(helper.double(int(sys.stdin.read())))"
    result = run_python(code, FAST, stdin="21", files={"helper.py": "def double(x):\n    return 2 * x\n"})
    assert result.ok and result.stdout == "42\n"
    script = tmp_path / "prog.py"
    script.write_text("print('from file')")
    assert run_file(script, FAST).stdout == "from file\n"


def test_files_may_not_escape_the_workdir():
    with pytest.raises(ValueError, match="files"):
        run_python("pass", FAST, files={"../x.py": ""})


def test_workdir_is_fresh_and_removed_afterwards():
    result = run_python("import os\nprint(os.getcwd())\nprint(os.listdir('.'))", FAST)
    workdir, listing = result.stdout.splitlines()
    assert listing == "['main.py']"
    assert not os.path.exists(workdir)


# ----------------------------------------------------------------------------- hostile programs


def test_infinite_loop_is_killed_at_the_wall_clock_timeout():
    result, marker = _run_marked("while True:\n    pass", SandboxConfig(timeout_s=1))
    assert result.timed_out and result.limit_hit == "timeout" and not result.ok
    assert result.signal == signal.SIGKILL and 0.9 < result.duration_s < 2.5
    _assert_host_fine(marker)


def test_cpu_time_limit():
    result = run_python("while True:\n    pass", SandboxConfig(timeout_s=20, cpu_time_s=1))
    assert result.limit_hit == "cpu_time" and not result.timed_out and result.signal == signal.SIGXCPU


@needs_root
def test_fork_bomb_is_capped_and_fully_killed():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result, marker = _run_marked(code, SandboxConfig(timeout_s=2, max_processes=16, require=("uid-drop",)))
    assert not result.ok and result.limit_hit in ("timeout", "processes")
    assert "rlimit_nproc" in result.protections and result.uid is not None
    _assert_host_fine(marker)


def test_memory_bomb_hits_the_memory_limit():
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))"
    result, marker = _run_marked(code, SandboxConfig(timeout_s=5, memory_mb=128))
    assert result.limit_hit == "memory" and not result.ok and "MemoryError" in result.stderr
    _assert_host_fine(marker)


def test_huge_output_is_truncated_and_the_flood_killed():
    result = run_python("while True:\n    print('x' * 1000)", SandboxConfig(timeout_s=5, max_output_bytes=4096))
    assert result.limit_hit == "output" and not result.timed_out and result.stdout_truncated
    assert len(result.stdout) == 4096 and result.duration_s < 4
    moderate = run_python("print('y' * 10000)", SandboxConfig(timeout_s=3, max_output_bytes=100))
    assert moderate.ok and moderate.stdout == "y" * 100 and moderate.stdout_truncated


def test_deep_recursion_is_contained():
    plain = run_python("def f(n):\n    return f(n + 1)\nf(0)", FAST)
    assert plain.exit_code == 1 and "RecursionError" in plain.stderr
    code = "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1)\nf(0)"
    unbounded, marker = _run_marked(code, SandboxConfig(timeout_s=3, memory_mb=64))  # frames live on the heap
    assert not unbounded.ok and (unbounded.signal is not None or unbounded.exit_code != 0)
    _assert_host_fine(marker)


def test_file_size_and_open_file_limits():
    big = run_python("open('f', 'wb').write(b'x' * 3 * 2 ** 20)", SandboxConfig(max_file_size_mb=1))
    assert big.limit_hit == "file_size" and "File too large" in big.stderr
    many = run_python("fs = [open('main.py') for _ in range(1000)]", SandboxConfig(max_open_files=32))
    assert many.limit_hit == "open_files"


def test_filling_the_disk_is_capped_by_a_private_tmpfs():
    code = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * 2 ** 20)"
    result = run_python(code, SandboxConfig(timeout_s=3, tmpfs_mb=4))
    if "tmpfs-workdir" not in result.protections:
        pytest.skip(f"no private tmpfs for the workdir here: {result.warnings}")
    assert result.limit_hit == "disk_space" and "No space left" in result.stderr


@needs_root
def test_host_unix_sockets_under_run_are_hidden():
    path = f"/run/tamer-sandbox-test-{os.getpid()}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)  # anyone may connect, as with D-Bus or PostgreSQL sockets
    server.listen(1)
    try:
        result = run_python(_connect_code(f"socket.socket(socket.AF_UNIX).connect({path!r})"), FAST)
    finally:
        server.close()
        os.unlink(path)
    if "hidden-dirs" not in result.protections:
        pytest.skip(f"no mount namespace here: {result.warnings}")
    assert result.stdout.startswith("blocked"), result.stdout


def test_writing_outside_the_workdir_leaves_the_host_untouched(tmp_path):
    token = os.urandom(4).hex()
    targets = [f"/tmp/tamer-evil-{token}", f"/var/tmp/tamer-evil-{token}", f"/dev/shm/tamer-evil-{token}",
               f"../tamer-evil-{token}", f"/root/tamer-evil-{token}", f"/etc/tamer-evil-{token}",
               str(tmp_path / "evil")]
    code = f"for p in {targets!r}:\n    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass"
    result = run_python(code, FAST)
    assert result.exit_code == 0
    host_paths = [p for p in targets if p.startswith("/")] + [os.path.join(tempfile.gettempdir(), targets[3][3:])]
    assert [p for p in host_paths if os.path.exists(p)] == []


@needs_root
def test_user_files_and_environment_secrets_do_not_leak(tmp_path, monkeypatch):
    monkeypatch.setenv("TAMER_TEST_SECRET", "env-secret-5f2a")
    secret = tmp_path / "secret.txt"
    secret.write_text("file-secret-9c1e")
    secret.chmod(0o600)
    code = f"""
import os
import shutil
print(dict(os.environ))
for path in [{str(secret)!r}, '/proc/{os.getpid()}/environ', '/proc/{os.getppid()}/environ',
             os.path.expanduser('~root/.bash_history'), '/etc/shadow']:
    try:
        print(open(path, 'rb').read())
    except OSError as exc:
        print('denied', path, type(exc).__name__)
"""
    result = run_python(code, DROPPED)
    assert result.exit_code == 0, result.stderr
    assert "env-secret-5f2a" not in result.stdout + result.stderr
    assert "file-secret-9c1e" not in result.stdout + result.stderr
    assert "TAMER_TEST_SECRET" not in result.stdout and result.stdout.count("denied") == 5


class _Server:
    """A bounded TCP server on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port, self.accepted, self._stop = self.sock.getsockname()[1], 0, threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _connect_code(connect: str) -> str:
    """A program that runs the statement `connect` and prints whether it got through."""
    return (f"import socket\ntry:\n    {connect}\n    print('connected')\n"
            "except OSError as exc:\n    print('blocked', exc)")


def _tcp_connect_code(port: int) -> str:
    return _connect_code(f"socket.create_connection(('127.0.0.1', {port}), timeout=1).close()")


@pytest.mark.parametrize("fallback", [False, True], ids=["netns", "seccomp"])
def test_network_connection_to_localhost_is_blocked(monkeypatch, fallback):
    if fallback:  # pretend the kernel refuses network namespaces; the forked child sees the patch
        monkeypatch.setattr(sandbox.linux, "enter_netns", lambda fd: False)
    server = _Server()
    try:
        result = run_python(_tcp_connect_code(server.port) + "\nsocket.socketpair()", FAST)
        allowed = run_python(_tcp_connect_code(server.port), SandboxConfig(timeout_s=3, network="allow"))
    finally:
        server.close()
    layer = "seccomp-net" if fallback else "netns"
    if layer not in result.protections:
        pytest.skip(f"{layer} not available here: {result.warnings}")
    assert result.exit_code == 0, result.stderr  # AF_UNIX socketpair still works
    assert result.stdout.startswith("blocked") and allowed.stdout == "connected\n"
    assert server.accepted == 1  # only the run with network="allow"


@needs_root
def test_killing_the_parent_is_refused():
    code = f"""
import os, signal
for pid, sig in ((os.getppid(), signal.SIGKILL), ({os.getpid()}, signal.SIGTERM)):
    try:
        os.kill(pid, sig)
        print('sent', pid)
    except OSError as exc:
        print('denied', type(exc).__name__)
"""
    result = run_python(code, DROPPED)
    assert result.stdout.count("denied PermissionError") == 2, result.stdout + result.stderr
    assert result.exit_code == 0  # and this test process is still here to check it


@needs_root
def test_spawned_shell_is_as_contained_as_the_program():
    token = os.urandom(4).hex()
    code = ("import subprocess\nout = subprocess.run(['/bin/sh', '-c', "
            f"'id -u; cat /etc/shadow; echo x > /root/pwned-{token}; echo done'], capture_output=True, text=True)\n"
            "print(out.stdout)\nprint(out.stderr)")
    result, marker = _run_marked(code, DROPPED)
    lines = result.stdout.splitlines()
    assert lines[1] == str(result.uid) and "done" in lines and "root:" not in result.stdout
    assert not os.path.exists(f"/root/pwned-{token}")
    _assert_host_fine(marker)


@needs_root
@pytest.mark.parametrize("holds_pipes", [True, False], ids=["holding-pipes", "detached"])
def test_no_background_process_survives_the_run(holds_pipes):
    detach = "" if holds_pipes else "        os.dup2(os.open(os.devnull, os.O_RDWR), 1)\n        os.dup2(1, 2)\n"
    code = f"""
import os, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()                     # leave the session: killpg alone would miss it
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        os.close(w)
{detach}        time.sleep(60)
    os._exit(0)
os.close(w)
print(os.read(r, 32).decode())
"""
    result, marker = _run_marked(code, DROPPED)
    assert int(result.stdout.split()[1]) > 0  # the daemon's pid
    assert result.ok and not result.timed_out  # the run ended with its main process
    _assert_host_fine(marker)


# ------------------------------------------------------------------------- fallbacks and pool


@needs_root
def test_missing_layers_are_reported_and_require_enforces_them(monkeypatch):
    real = sandbox.linux.unshare  # the forked child sees the patch: refuse it a mount namespace
    monkeypatch.setattr(sandbox.linux, "unshare", lambda flags: not flags & sandbox.linux.CLONE_NEWNS and real(flags))
    result = run_python("print('still runs')", FAST)
    assert result.ok and "mountns" not in result.protections
    assert any("mount namespace" in w for w in result.warnings)
    with pytest.raises(SandboxError, match="mountns"):
        run_python("print('never')", SandboxConfig(timeout_s=3, require=("mountns",)))


def test_pool_runs_concurrently_and_keeps_order():
    # Each program prints when it started and ended (the sandbox shares the host's clock).
    code = "import sys, time\nstart = time.time()\ntime.sleep(0.5)\nprint(sys.stdin.read(), start, time.time())"
    with SandboxPool(max_workers=2, config=SandboxConfig(timeout_s=10)) as pool:
        results = pool.map([code] * 4, stdins=["a", "b", "c", "d"])
        assert pool.submit("print('f')").result().stdout == "f\n"
    assert [r.stdout.split()[0] for r in results] == ["a", "b", "c", "d"]
    (start_a, end_a), (start_b, end_b) = (map(float, r.stdout.split()[1:]) for r in results[:2])
    assert start_a < end_b and start_b < end_a  # the first two ran at the same time
    if os.geteuid() == 0:
        assert results[0].uid != results[1].uid  # so they never shared a uid


# ----------------------------------------------------------------------------------------- CLI


def test_cli_prints_one_json_object_and_exits_zero_whatever_the_code_did(tmp_path):
    runner = CliRunner()
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("print('hi')")
    bad.write_text("while True:\n    pass")
    out = runner.invoke(sandbox_app, ["run", str(good), "--timeout", "3", "--memory-mb", "256"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.stdout)
    assert payload["ok"] and payload["stdout"] == "hi\n" and payload["exit_code"] == 0
    out = runner.invoke(sandbox_app, ["run", str(bad), "--timeout", "1"])
    assert out.exit_code == 0 and json.loads(out.stdout)["limit_hit"] == "timeout"


def test_cli_missing_file_and_bad_network_exit_2(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(sandbox_app, ["run", str(tmp_path / "nope.py")])
    assert missing.exit_code == 2 and "no such file" in missing.output
    (tmp_path / "a.py").write_text("pass")
    bad = runner.invoke(sandbox_app, ["run", str(tmp_path / "a.py"), "--network", "open"])
    assert bad.exit_code == 2 and "--network" in bad.output


# ------------------------------------------------------------------ cleanup without the supervisor


def test_run_lives_in_its_own_pid_namespace():
    code = "import os\nif os.fork() == 0:\n    print(os.getpid(), os.getppid())\n    os._exit(0)\nos.wait()"
    result = run_python(code, FAST)
    if "pidns" not in result.protections:
        pytest.skip(f"no PID namespace here: {result.warnings}")
    pid, ppid = map(int, result.stdout.split())
    assert pid == 2 and ppid == 0  # the reaper is PID 1; the program's own pid is in the host's namespace


def test_no_pid_namespace_is_reported_and_require_enforces_it(monkeypatch):
    real = sandbox.linux.unshare  # the forked child sees the patch: refuse it a PID namespace
    monkeypatch.setattr(sandbox.linux, "unshare", lambda flags: not flags & sandbox.linux.CLONE_NEWPID and real(flags))
    result = run_python("print('still runs')", FAST)
    assert result.ok and "pidns" not in result.protections
    assert any("no PID namespace" in w for w in result.warnings)
    with pytest.raises(SandboxError, match="pidns"):
        run_python("print('never')", SandboxConfig(timeout_s=3, require=("pidns",)))


def test_stale_workdirs_of_dead_supervisors_are_swept(tmp_path):
    from tamer.tools.sandbox import run as run_module

    probe = subprocess.Popen(["true"])  # a pid that has surely exited
    probe.wait()
    stale = Path(tempfile.gettempdir(), f"tamer-sbx-{probe.pid}-test{os.urandom(3).hex()}")
    live = Path(tempfile.gettempdir(), f"tamer-sbx-{os.getppid()}-test{os.urandom(3).hex()}")
    for d in (stale, live):
        d.mkdir()
        (d / "main.py").write_text("print(1)")
    try:
        run_module.sweep_stale_workdirs.cache_clear()
        removed = run_module.sweep_stale_workdirs()
        assert stale.name in removed and not stale.exists()
        assert live.exists()  # its supervisor (our parent) is alive
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)

"""Run untrusted Python (model-written code, reward checks) in a separate, locked-down process.

    from tamer.tools.sandbox import SandboxConfig, SandboxPool, run_python

    result = run_python("print(sum(range(10)))", SandboxConfig(timeout_s=5))
    result.ok, result.stdout            # True, "45\\n"
    result.limit_hit                    # None | "timeout" | "cpu_time" | "memory" | ...
    result.protections                  # what was actually in force for this run

    with SandboxPool(max_workers=4) as pool:     # many runs at once, for rollouts and rewards
        results = pool.map(["print(1)", "while True: pass"])

Each run gets a fresh working directory (removed afterwards), a scrubbed environment, its own
process group and a wall-clock deadline. Inside the forked child, before exec, `child.child_setup`
adds what the kernel and our privileges allow:
  * no network: an empty network namespace (one per concurrent uid, reused); if namespaces are
    refused, a seccomp filter that lets socket() make only AF_UNIX sockets;
  * a private mount namespace: size-capped tmpfs on /tmp (holding a copy of the workdir), /var/tmp
    and /dev/shm; the invoking user's home and /run covered by empty tmpfs (the interpreter is
    bound back read-only if it lives there); the root filesystem read-only;
  * resource limits: address space, CPU time, processes, file size, open files, no core dumps;
  * as root: a per-run unprivileged uid/gid without groups, so RLIMIT_NPROC binds, file
    permissions apply and signals to host processes are refused; no-new-privs; parent-death signal.
After the run every process of that uid is killed (`kill(-1)` from a helper running as the uid),
which also catches daemons that left the process group. Independently of the supervisor, the run's
processes live in their own PID namespace whose PID 1 (reaper.py) kills them all and removes the
workdir when the program exits, even if the supervisor was killed with SIGKILL. What could not be set up is listed in
`SandboxResult.warnings`; `SandboxConfig.require` turns a missing layer into a `SandboxError`.
docs/sandbox.md says in plain words what this protects against and what it does not.

The modules, in the order a run passes through them:
  config.py     SandboxConfig, SandboxResult, SandboxError, the protection names
  run.py        run_python / run_file: lease a uid, make the workdir, execute
  plan.py       what the child will do, computed in the parent before the fork
  supervise.py  spawn, pump the pipes, enforce the deadline and output cap, sweep, name the limit
  child.py      the forked child's setup before exec: namespaces, mounts, rlimits, uid drop
  reaper.py     the run's PID namespace and its PID 1: cleanup that survives the supervisor
  linux.py      ctypes primitives: unshare, setns, mount, prctl, seccomp
  pool.py       SandboxPool: many runs at once
"""

from tamer.tools.sandbox.config import (
    KNOWN_PROTECTIONS,
    NETWORK_MODES,
    SandboxConfig,
    SandboxError,
    SandboxResult,
)
from tamer.tools.sandbox.pool import SandboxPool
from tamer.tools.sandbox.run import run_file, run_python

__all__ = [
    "KNOWN_PROTECTIONS", "NETWORK_MODES", "SandboxConfig", "SandboxError", "SandboxPool", "SandboxResult",
    "run_file", "run_python",
]

"""Running a test's worker script in its own process group, bounded in time.

The distributed tests start their processes (torch.distributed on gloo over
loopback, or JAX with virtual CPU devices) from a worker script run here: a
run past its time limit kills the script and every process it started.
"""

import os
import signal
import subprocess
import sys

# The repository's root (on the workers' PYTHONPATH).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_worker(script, *args, timeout, **env):
    """Runs ``python script *args`` with this repository first on
    ``PYTHONPATH``, one thread per process and ``env`` added; fails the test
    with the worker's output where it fails or runs past ``timeout`` seconds."""
    path = [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", **env)
    proc = subprocess.Popen([sys.executable, script, *map(str, args)], cwd=REPO, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's session: it and the processes it started
        output, _ = proc.communicate()
        raise AssertionError(f"{os.path.basename(script)} ran past {timeout} s:\n{output[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{os.path.basename(script)} failed (exit {proc.returncode}):\n{output[-6000:]}")
    return output

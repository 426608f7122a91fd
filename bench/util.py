"""What several bench_*.py scripts share: a child JAX process's environment, and starting a server process."""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env():
  """For a child JAX process: CPU, unbuffered output, one device (the parent's XLA_FLAGS are not inherited)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)
  return env


def start_server(port_file, *flags, script=("param_server.py",), log=None, **popen):
  """Starts `python *SCRIPT --port_file=PORT_FILE *FLAGS` in ROOT (output appended to `log` if given; more Popen
  arguments in popen) and waits until it has written its port there; returns (process, port). Kills it and
  raises RuntimeError if it exits first or has not written the port within 30 s."""
  if os.path.exists(port_file):
    os.remove(port_file)
  if log:
    popen["stdout"] = popen["stderr"] = open(log, "ab")
  p = subprocess.Popen([sys.executable, *script, f"--port_file={port_file}", *flags], cwd=ROOT,
                       **popen)
  t0 = time.monotonic()
  while not os.path.exists(port_file):
    if p.poll() is not None or time.monotonic() - t0 > 30:
      p.kill()
      raise RuntimeError(f"{script} did not start" + (f" (see {log})" if log else ""))
    time.sleep(0.02)
  return p, int(open(port_file).read())

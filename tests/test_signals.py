"""Signals as users send them, to a real `launch.sh local` started with job control (its own process group, as a
terminal starts it): Ctrl-C to the group, SIGTERM to launch.sh alone, SIGHUP to the group, and SIGINT to a
launch.sh started from a script that ignores SIGINT. Each ends in the ordered stop (trainer checkpoint first, server
last) with no process of the run left; a second launch on the same run dir is refused while one runs; the last
rerun finishes, and every step was trained exactly once across the five launches. ~3-4 min on 2 cores."""
import json
import os
import signal
import subprocess
import time

from bench import util as benchutil
import data
from test_system import ROOT, free_port, steps_done, tiny_base

STEPS = 20  # (8 was all done before the fourth signal once collection got faster)


def launch_cmd(run, port):
  return ["bash", "launch.sh", "local", f"--run_dir={run}", f"--steps={STEPS}", f"--port={port}", "--skip_eval",
          "--no_chaos", "--workers=1", "--worker_args=--lease_s=6 --slots=8 --chunk_steps=4 --verifier_workers=0",
          "--", "--prompts_per_step=2", "--group_size=4", "--checkpoint_every=100", "--task_args=difficulty=1,ops=+-",
          "--get_wait_s=0.5", "--train_size=100", "--prefetch_steps=1", "--max_staleness=1"]


def processes_of(run):
  """pids of live processes whose command line names the run dir (every role's does), but not this test's."""
  out = []
  for p in os.listdir("/proc"):
    if p.isdigit() and int(p) != os.getpid():
      try:
        cmd = open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
        state = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0]
      except OSError:
        continue
      if run in cmd and state != "Z":
        out.append((int(p), cmd.replace("\0", " ")[:200]))
  return out


def start(run, port, log, wrap=None):
  cmd = launch_cmd(run, port)
  if wrap:  # a script that ignores SIGINT, then execs launch.sh (which inherits the ignored disposition)
    cmd = ["bash", "-c", 'trap "" INT; exec "$@"', "bash", *cmd]
  return subprocess.Popen(cmd, cwd=ROOT, env=benchutil.child_env(), stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)


def wait_steps(run, proc, n, logpath):
  t0 = time.time()
  while steps_done(run) < n:
    assert proc.poll() is None, open(logpath).read()[-3000:]
    assert time.time() - t0 < 300, f"no step {n} within 300 s"
    time.sleep(0.3)


def stop_and_check(run, proc, send, logpath, how):
  before = steps_done(run)
  send()
  assert proc.wait(timeout=200) == 0, open(logpath).read()[-3000:]
  out = open(logpath).read()
  assert f"stopping (SIG{how})" in out, out[-2000:]
  left = processes_of(run)
  assert not left, left
  ckpts = sorted(int(d) for d in os.listdir(os.path.join(run, "ckpt")) if d.isdigit())
  assert ckpts and ckpts[-1] == steps_done(run) >= before, (ckpts, steps_done(run))  # the final checkpoint


def test_signals_end_in_the_ordered_stop_and_every_step_is_trained_once(tmp_path):
  run = str(tmp_path / "run")
  os.makedirs(run)
  tiny_base(run, data.load_tokenizer(data.build_task_tokenizer(run, "arithmetic", seed=0)))
  port = free_port()
  procs = []
  try:
    cases = [("INT", lambda p: os.killpg(p.pid, signal.SIGINT), None),  # Ctrl-C in a terminal
             ("TERM", lambda p: os.kill(p.pid, signal.SIGTERM), None),  # launch.sh stop, a preemption notice
             ("HUP", lambda p: os.killpg(p.pid, signal.SIGHUP), None),  # the terminal closed
             ("INT", lambda p: os.kill(p.pid, signal.SIGINT), "ignored")]  # started by a script ignoring SIGINT
    for i, (how, send, wrap) in enumerate(cases):
      logpath = str(tmp_path / f"launch{i}.log")
      with open(logpath, "w") as log:
        proc = start(run, port, log, wrap)
        procs.append(proc)
        wait_steps(run, proc, steps_done(run) + 1, logpath)
        if i == 1:  # one trainer per run: a second launch on the same run dir is refused at once
          second = subprocess.run(launch_cmd(run, free_port()), cwd=ROOT, env=benchutil.child_env(),
                                  capture_output=True, text=True, timeout=60)
          assert second.returncode == 2 and "is in use by pid" in second.stderr, second.stderr
          assert f"pid {proc.pid}" in second.stderr or "bash launch.sh local" in second.stderr
        stop_and_check(run, proc, lambda: send(proc), logpath, how)
    assert steps_done(run) < STEPS, "the run finished before the last signal: nothing left to test"
    logpath = str(tmp_path / "launch_last.log")
    with open(logpath, "w") as log:
      proc = start(run, port, log)
      procs.append(proc)
      assert proc.wait(timeout=400) == 0, open(logpath).read()[-3000:]
    assert open(os.path.join(run, "DONE")).read() == str(STEPS)
    steps = [json.loads(l)["step"] for l in open(os.path.join(run, "metrics.jsonl")) if '"step"' in l]
    assert sorted(steps) == list(range(1, STEPS + 1)), steps  # each step once: no step trained twice or lost
    assert not processes_of(run)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    for pid, _ in processes_of(run):
      os.kill(pid, signal.SIGKILL)


def launch_fn(name, args):
  """Calls launch.sh's bash function `name` (its text cut from launch.sh itself) with `args`."""
  src = open(os.path.join(ROOT, "launch.sh")).read()
  body = src[src.index(f"\n{name}() {{") + 1:]
  body = body[:body.index("\n}\n") + 3]
  return subprocess.run(["bash", "-c", body + name + args], capture_output=True, text=True, timeout=30)


def test_supervisor_quotes_the_error_and_retries_transient_failures_with_backoff(tmp_path):
  log = tmp_path / "role.log"
  bar = "grpo:   0%|          | 0/100 [00:00<?, ?it/s]\r"
  log.write_text("I1206 starting\n" + bar + "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                 "    f()\nRuntimeError: RESOURCE_EXHAUSTED: out of memory allocating 37.8G\n" + bar)
  r = launch_fn("last_error_line", f' "{log}" 0')
  assert r.stdout.strip() == "RuntimeError: RESOURCE_EXHAUSTED: out of memory allocating 37.8G", r
  log.write_text("FATAL Flags parsing error: Unknown command line flag 'lr_x'\nPass --helpshort or --helpfull to see "
                 "help on flags.\n")
  assert launch_fn("last_error_line", f' "{log}" 0').stdout.strip().startswith("FATAL Flags parsing error: Unknown")
  for line, transient in (("ConnectionRefusedError: [Errno 111] Connection refused", True),
                          ("OSError: [Errno 28] No space left on device", True),
                          ("param_server.StorageError: queue log append failed", True),
                          ("ValueError: data.jsonl:61: missing field 'answer'", False),
                          ("FATAL Flags parsing error: Unknown command line flag 'x'", False)):
    assert (launch_fn("is_transient", f" {json.dumps(line)}").returncode == 0) is transient, line

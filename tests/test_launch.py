"""launch.sh as a user runs it: the pod launcher against a fake gcloud (tests/fake_gcloud.py: every TPU host is a
directory on this machine, every `ssh --worker=i --command=C` runs C there), and the guards around a local run.

The pod tests check the launcher's slices (accelerator type, runtime version, hosts) against the fake's own table of
the Cloud TPU docs (tests/tpu_types.json), per generation, in dry runs and fake runs; two really start a server, a
multi-process trainer and workers through launch.sh v5p-16 / v6e-8 and finish a few RL steps on a tiny random
policy, one of them with a verifier on a Spot CPU VM and preempting the spot slice and the VM mid-run: the launcher
re-creates both and the run ends at its last step.
"""
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

from bench import util as benchutil
import data
import fake_gcloud
from test_system import ROOT, kill_roles, steps_done, tiny_base


def run(cmd, **kw):
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=benchutil.child_env(), **kw)


# ------------------------------------------------------------------------------------------------ pod: the docs' table


def dry(size, *flags):
  r = run(["bash", "launch.sh", size, "--tpu=t", "--zone=z", "--dry_run", "--state_dir=/nonexistent", *flags])
  assert r.returncode == 0, r.stderr
  return r.stdout


def created(out, node):
  """The accelerator type and runtime of the queued resource `out` creates for NODE (dry-run output or calls)."""
  for line in out.splitlines():
    argv = shlex.split(line)
    if argv[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"] and f"--node-id={node}" in argv:
      kv = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
      return kv["accelerator-type"], kv["runtime-version"], "--spot" in argv
  return None


# Per generation: the user's spelling, gcloud's accelerator type; hosts come from the fake's own table.
SIZES = [("v4-8", "v4-8"), ("v4-32", "v4-32"), ("v4-1024", "v4-1024"), ("v5p-8", "v5p-8"), ("v5p-16", "v5p-16"),
         ("v5p-1024", "v5p-1024"), ("v5e-8", "v5litepod-8"), ("v5e-16", "v5litepod-16"),
         ("v5litepod-256", "v5litepod-256"), ("v6e-8", "v6e-8"), ("v6e-16", "v6e-16"), ("v6e-256", "v6e-256")]


def test_pod_dry_run_per_generation_matches_the_fakes_table_of_the_docs():
  for size, accel in SIZES:
    out = dry(size, "--infer_size=v6e-1")
    accel_made, runtime, spot = created(out, "t")
    assert accel_made == accel and not spot, (size, out[:400])
    hosts = fake_gcloud.workers(accel, runtime)  # the fake refuses a type / runtime the docs do not list
    assert f"{hosts} trainer hosts" in out, (size, hosts, out[:300])
    trainers = [l for l in out.splitlines() if " ssh t " in l and "train.py" in l]
    assert len(trainers) == hosts and f"--process_id={hosts - 1} " in trainers[-1], size
  assert created(dry("v5p-16", "--spot"), "t-infer") == ("v5p-16", "v2-alpha-tpuv5", True)


def test_pod_refuses_sizes_the_docs_do_not_list():
  for size, valid in [("v5p-12", "8, 16, 32, 64"), ("v5e-2", "1, 4, 8, 16"), ("v6e-512", "128, 256"),
                      ("v4-4", "8, 16, 32")]:
    r = run(["bash", "launch.sh", size, "--tpu=t", "--zone=z", "--dry_run"])
    assert r.returncode == 2 and valid in r.stderr, (size, r.stderr)
  r = run(["bash", "launch.sh", "v5p-64", "--dry_run"])
  assert r.returncode == 2 and "--tpu=NAME --zone=ZONE" in r.stderr


def test_fake_gcloud_refuses_what_the_docs_do_not_list(tmp_path):
  root, env = fake_pod(tmp_path)
  gc = ["gcloud", "compute", "tpus"]
  for argv, why in [(["tpu-vm", "create", "x", "--zone=z", "--accelerator-type=v5e-16", "--version=v2-alpha-tpuv5-lite"],
                     "unknown accelerator type 'v5e-16'"),  # gcloud spells it v5litepod-16
                    (["queued-resources", "create", "x-qr", "--node-id=x", "--zone=z", "--accelerator-type=v5p-16",
                      "--runtime-version=v2-alpha-tpuv5p-base"], "runtime version 'v2-alpha-tpuv5p-base'"),
                    (["queued-resources", "create", "x-qr", "--node-id=x", "--zone=z", "--accelerator-type=v6e-16",
                      "--runtime-version=v2-alpha-tpuv5"], "not a documented runtime for v6e-16")]:
    r = subprocess.run(gc + argv, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and why in r.stderr, (argv, r.stderr)
  assert not os.path.exists(os.path.join(root, "nodes"))
  vm = ["gcloud", "compute", "instances", "create", "v", "--zone=z"]
  for argv, why in [(["--machine-type=n2-standard-12", "--image-family=ubuntu-2204-lts", "--image-project=ubuntu-os-cloud"],
                     "'n2-standard-12' does not exist"),
                    (["--machine-type=n2-standard-8", "--image-family=ubuntu-2204-lts", "--image-project=debian-cloud"],
                     "images/family/ubuntu-2204-lts' was not found"),
                    (["--machine-type=n2-standard-8", "--image-family=debian-12", "--image-project=debian-cloud",
                      "--instance-termination-action=DELETE"], "only for --provisioning-model=SPOT")]:
    r = subprocess.run(vm + argv, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and why in r.stderr, (argv, r.stderr)
  assert not os.path.exists(os.path.join(root, "instances"))
  # launch.sh with a runtime the docs do not list fails at the fake, before any host is set up
  r = subprocess.run(["bash", "launch.sh", "v5p-8", "--tpu=t", "--zone=z", "--runtime=v2-alpha-tpuv5p-base",
                      f"--state_dir={tmp_path / 'state'}"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert r.returncode != 0 and "v2-alpha-tpuv5p-base" in r.stderr and "setting up" not in r.stdout, r.stdout + r.stderr


def test_pod_dry_run_commands_are_exact_and_parse():
  out = dry("v5p-16", "--spot", "--", "--steps=5")
  lines = [l for l in out.splitlines() if l.startswith("gcloud")]
  ssh = [shlex.split(l) for l in lines if " ssh " in l]
  # one server, a shard server on each other trainer host (1), one trainer per trainer host (2), one worker per
  # inference host (2), setup commands
  roles = [a for argv in ssh for a in argv if a.startswith("--command=") and "launch.sh host " in a]
  assert sum("param_server.py" in c and "--run_dir=" in c for c in roles) == 1
  assert sum("param_server.py" in c and "host shard1 " in c and "--port=5556" in c for c in roles) == 1
  assert sum("train.py" in c for c in roles) == 2 and sum("rollout.py" in c for c in roles) == 2
  assert all("--shard_servers=self:5556" in c for c in roles if "train.py" in c)
  assert any("--process_id=1" in c and "--num_processes=2" in c and "--steps=5" in c for c in roles)
  for argv in ssh:  # each remote command is one argument that bash parses
    cmd = [a for a in argv if a.startswith("--command=")][0][len("--command="):]
    assert subprocess.run(["bash", "-n"], input=cmd, text=True).returncode == 0, cmd
  assert created(out, "t") == ("v5p-16", "v2-alpha-tpuv5", True)
  assert any(" scp " in l and ".secrets/token" in l for l in lines)


def test_pod_dry_run_verifier_vms_are_spot_cpu_vms_the_fake_accepts(tmp_path):
  out = dry("v5p-16", "--spot", "--verifier_vms=2", "--verifier_machine=n2-standard-16",
            "--worker_args=--verifier_workers=2", "--verifier_args=--verifier_workers=16")
  argvs = [shlex.split(l) for l in out.splitlines() if l.startswith("gcloud compute ")]
  creates = [a for a in argvs if a[2:4] == ["instances", "create"]]
  assert [a[4] for a in creates] == ["t-verifier0", "t-verifier1"]
  root, env = fake_pod(tmp_path)
  for a in creates:  # what launch.sh asks for, the fake (the Compute Engine docs' types and images) accepts
    assert "--provisioning-model=SPOT" in a and "--machine-type=n2-standard-16" in a, a
    subprocess.run(a, env=env, check=True, capture_output=True)
  for vm in ("t-verifier0", "t-verifier1"):
    ssh = [a for a in argvs if a[2] == "ssh" and a[3] == vm]
    setup, role = ssh[0][-1], ssh[-1][-1]
    assert setup.endswith("bash rl/launch.sh host_setup requirements.txt"), setup  # CPU jax, no libtpu
    cmd = shlex.split(role[len("--command="):].split(" && ")[-1])
    assert cmd[3:9] == ["host", "verifier", "runs/pod", "rollout.py", "--mode=verifier", "--server=SERVER_IP:5555"] and f"--worker_id={vm}" in cmd
    assert cmd.index("--verifier_workers=16") > cmd.index("--verifier_workers=2"), cmd  # absl: the last one wins
    assert any(a[2] == "scp" and a[-2] == f"{vm}:rl/.secrets/token" for a in argvs)


# ------------------------------------------------------------------------------------------------ fake pod


def fake_pod(tmp_path, venv=os.path.join(ROOT, ".venv")):
  root = tmp_path / "gcloud"
  (root / "bin").mkdir(parents=True)
  gcloud = root / "bin" / "gcloud"
  gcloud.write_text(f"#!/bin/sh\nexec {sys.executable} {os.path.join(ROOT, 'tests', 'fake_gcloud.py')} \"$@\"\n")
  gcloud.chmod(0o755)
  env = benchutil.child_env()
  host_env = dict(RL_SKIP_INSTALL="1", VENV=venv, JAX_PLATFORMS="cpu", STOP_GRACE_S="30")
  env.update(PATH=f"{root / 'bin'}:{env['PATH']}", FAKE_GCLOUD_ROOT=str(root),
             FAKE_GCLOUD_HOST_ENV=json.dumps(host_env))
  env["VENV"] = os.path.join(ROOT, ".venv")
  return str(root), env


def calls(root, *words):
  return [c for c in map(json.loads, open(os.path.join(root, "calls.jsonl"))) if all(w in c for w in words)]


# What runs as `python` on the fake hosts of test_pod_fake_run_per_generation: it records its argv; trainer process 0
# writes DONE at once (every trainer process exits 0), the servers and workers wait to be stopped.
STUB_PYTHON = """#!/bin/bash
echo "$*" >>argv.log
[ "$1" = train.py ] || exec sleep 300
for a; do case "$a" in --run_dir=*) run="${a#*=}" ;; --process_id=*) id="${a#*=}" ;; esac; done
[ "$id" = 0 ] && echo 1 >"$run/DONE"; exit 0
"""


def test_pod_fake_run_per_generation_creates_reuses_and_starts_a_role_per_documented_host(tmp_path):
  """Not a dry run: launch.sh creates each slice (on-demand) through the fake, which gives it the number of workers
  its own table of the docs says, and starts trainer i / worker i on every one of them (a stub python: the
  orchestration, not JAX, is under test here; test_pod_v5p16_* trains for real)."""
  for size, infer in [("v4-16", "v4-8"), ("v5p-16", "v5p-8"), ("v5litepod-16", "v5e-4"), ("v6e-16", "v6e-4")]:
    tmp = tmp_path / size
    stub = tmp / "venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    root, env = fake_pod(tmp, venv=str(tmp / "venv"))
    reuse = size.startswith("v6e")
    if reuse:  # a READY inference slice of the wanted type is reused, not re-created
      subprocess.run(["gcloud", "compute", "tpus", "tpu-vm", "create", "t-infer", "--zone=z",
                      "--accelerator-type=v6e-4", "--version=v2-alpha-tpuv6e"], env=env, check=True)
    proc = subprocess.Popen(["bash", "launch.sh", size, "--tpu=t", "--zone=z", f"--infer_size={infer}", "--poll_s=1",
                             f"--state_dir={tmp / 'state'}"], cwd=ROOT, env=env, stdout=open(tmp / "launch.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    out = finish(proc, root, tmp, 120)
    for node, role in (("t", "trainer"), ("t-infer", "worker")):
      accel = json.load(open(os.path.join(root, "nodes", f"{node}.json")))["accel"]
      hosts = sorted(os.listdir(os.path.join(root, "hosts", node)))
      assert hosts == [f"w{i}" for i in range(fake_gcloud.workers(accel))], (size, node, hosts)
      for i, h in enumerate(hosts):
        argv = open(os.path.join(root, "hosts", node, h, "rl", "argv.log")).read()
        assert (f"--worker_id=worker{i}" if role == "worker" else f"--process_id={i} ") in argv, (node, h, argv)
    creates = calls(root, "queued-resources", "create")
    assert [c[4] for c in creates] == (["t-qr"] if reuse else ["t-qr", "t-infer-qr"]), creates
    assert not any("--spot" in c for c in creates)  # on-demand without --spot
    assert ("reusing slice t-infer" in out) == reuse and "training done" in out, out[-2000:]


def test_pod_refuses_to_reuse_a_slice_of_another_type(tmp_path):
  root, env = fake_pod(tmp_path)
  subprocess.run(["gcloud", "compute", "tpus", "tpu-vm", "create", "t", "--zone=z", "--accelerator-type=v5p-8",
                  "--version=v2-alpha-tpuv5"], env=env, check=True)
  r = subprocess.run(["bash", "launch.sh", "v5p-16", "--tpu=t", "--zone=z", f"--state_dir={tmp_path / 'state'}"],
                     cwd=ROOT, env=env, capture_output=True, text=True)
  assert r.returncode == 2 and "slice t exists as v5p-8, not v5p-16" in r.stderr, r.stdout + r.stderr
  assert not calls(root, "create", "t-qr") and not calls(root, "delete")


def base_and_tokenizer(tmp_path):
  src = str(tmp_path / "src")
  os.makedirs(src)
  tok_path = data.build_task_tokenizer(src, "arithmetic", seed=0)
  tiny_base(src, data.load_tokenizer(tok_path))
  return os.path.join(src, "base"), tok_path


TRAIN = ["--prompts_per_step=2", "--group_size=4", "--task_args=difficulty=1,ops=+-", "--checkpoint_every=1",
         "--get_wait_s=0.5", "--train_size=100", "--prefetch_steps=1", "--mesh=-1,1,1"]
WORKER = "--slots=8 --chunk_steps=4 --verifier_workers=0 --lease_s=10"


def pod_ports():
  """(port, coord_port) for a fake pod: the pod's shard servers listen on port + 1, which a plain free port does not
  reserve (a shard once failed with EADDRINUSE there), so take three consecutive ports, free now, below Linux's
  ephemeral range (32768+), where no connection's local port lands."""
  rng = random.Random()
  while True:
    port = rng.randrange(20000, 32000)
    try:
      with socket.socket() as a, socket.socket() as b, socket.socket() as c:
        for sock, p in ((a, port), (b, port + 1), (c, port + 2)):
          sock.bind(("127.0.0.1", p))
      return port, port + 2
    except OSError:
      continue


def pod_launch(size, tmp_path, env, steps, *flags, train=()):
  ckpt, tok = base_and_tokenizer(tmp_path)
  port, coord = pod_ports()
  cmd = ["bash", "launch.sh", size, "--tpu=t", "--zone=z", f"--port={port}", f"--coord_port={coord}",
         f"--init_checkpoint={ckpt}", f"--tokenizer={tok}", "--poll_s=1", f"--worker_args={WORKER}",
         f"--state_dir={tmp_path / 'state'}", *flags,
         "--", f"--steps={steps}", *TRAIN, *train]
  log = open(tmp_path / "launch.log", "w")
  return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc, root, tmp_path, timeout):
  try:
    rc = proc.wait(timeout=timeout)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
    for kind in ("nodes", "instances"):
      for node in os.listdir(os.path.join(root, kind)) if os.path.isdir(os.path.join(root, kind)) else []:
        fake_gcloud.ROOT = root
        fake_gcloud._kill_node(node[:-len(".json")])
  out = open(tmp_path / "launch.log").read()
  assert rc == 0, out[-4000:]
  return out


def no_secret_on_command_lines(root, token):
  calls = open(os.path.join(root, "calls.jsonl")).read()
  assert token not in calls


def test_pod_v5p16_fake_gcloud_runs_rl_steps(tmp_path):
  root, env = fake_pod(tmp_path)
  for name in ("t", "t-infer"):  # made by hand beforehand: reused, not re-created
    subprocess.run(["gcloud", "compute", "tpus", "tpu-vm", "create", name, "--zone=z", "--accelerator-type=v5p-16",
                    "--version=v2-alpha-tpuv5"], env=env, check=True)
  # Checkpoints of a multi-host trainer go to storage every host shares (a bucket on a real pod).
  proc = pod_launch("v5p-16", tmp_path, env, 3, train=[f"--checkpoint_dir={tmp_path / 'shared_ckpt'}"])
  out = finish(proc, root, tmp_path, 400)
  assert "2 trainer hosts; t-infer: v5p-16, 2 inference hosts" in out and "training done" in out
  assert "reusing slice t (v5p-16, READY)" in out and not calls(root, "create", "t-qr")
  host0 = os.path.join(root, "hosts", "t", "w0", "rl")
  run_dir = os.path.join(host0, "runs", "pod")
  assert open(os.path.join(run_dir, "DONE")).read() == "3"
  assert steps_done(run_dir) == 3
  # a 2-process trainer: process 1 ran on host w1 (its own copy of the project), the workers on the infer slice
  assert os.path.exists(os.path.join(root, "hosts", "t", "w1", "rl", "runs", "pod", "logs", "trainer1.log"))
  for i in (0, 1):
    assert os.path.exists(os.path.join(root, "hosts", "t-infer", f"w{i}", "rl", "runs", "pod", "logs", f"worker{i}.log"))
  token = open(tmp_path / "state" / "token").read().strip()
  assert open(os.path.join(host0, ".secrets", "token")).read().strip() == token
  no_secret_on_command_lines(root, token)


def test_pod_v6e8_spot_preemption_recreates_slice_and_finishes(tmp_path):
  root, env = fake_pod(tmp_path)
  shared = str(tmp_path / "shared_run")  # like a gcsfuse mount: survives the slice, so the trainer resumes
  steps = 5
  # --max_staleness=1: each step after the second needs rollouts of a newer policy, so the run cannot finish on the
  # rollouts the workers queued while the trainer compiled (with the default 4 it once ran steps 1-5 in 0.4 s, and
  # the pod was preempted after DONE).
  # One verifier VM (a Spot CPU VM): the workers send it their groups to score.
  proc = pod_launch("v6e-8", tmp_path, env, steps, "--spot", f"--run_dir={shared}", "--verifier_vms=1",
                    train=["--max_staleness=1"])
  t0 = time.time()
  while steps_done(shared) < 2:
    assert proc.poll() is None, open(tmp_path / "launch.log").read()[-3000:]
    assert time.time() - t0 < 300, "no training step within 300 s"
    time.sleep(0.2)
  fake_gcloud.preempt(root, "t")  # kills every process on the slice before it returns
  fake_gcloud.preempt(root, "t-verifier0")  # --instance-termination-action=DELETE: the VM is gone
  assert not os.path.exists(os.path.join(shared, "DONE")), "the run finished before the preemption: nothing tested"
  out = finish(proc, root, tmp_path, 400)
  assert "t is PREEMPTED" in out and "t-verifier0 is MISSING" in out and "training done" in out, out[-3000:]
  creates = calls(root, "create", "t-qr")
  assert len(creates) == 2 and all("--spot" in c and "--accelerator-type=v6e-8" in c for c in creates)
  vms = calls(root, "instances", "create", "t-verifier0")
  assert len(vms) == 2 and all("--provisioning-model=SPOT" in c for c in vms)
  assert open(os.path.join(shared, "DONE")).read() == str(steps)
  recs = [json.loads(l) for l in open(os.path.join(shared, "metrics.jsonl"))]
  assert {r["step"] for r in recs} == set(range(1, steps + 1))
  assert any(r.get("scored_by_verifier", 0) > 0 for r in recs), recs  # the VM's verifier scored rollouts
  # the re-created VM got the project again and started its verifier (its own log, on its own host)
  log = open(os.path.join(root, "hosts", "t-verifier0", "w0", "rl", shared, "logs", "verifier.log")).read()
  assert "serving the queue to_score" in log, log[-2000:]


# ------------------------------------------------------------------------------------------------ local runs


def real_inputs(tmp_path):
  """A tiny random HF checkpoint + its tokenizer + train/eval jsonl files (arithmetic problems as a user's data)."""
  ckpt, tok = base_and_tokenizer(tmp_path)
  train, ev = str(tmp_path / "train.jsonl"), str(tmp_path / "eval.jsonl")
  data.write_jsonl(train, data.make_task_problems("arithmetic", 60, difficulty=1, seed=0, split="train", ops="+-"))
  data.write_jsonl(ev, data.make_task_problems("arithmetic", 8, difficulty=1, seed=1, split="eval", ops="+-"))
  return ckpt, tok, train, ev


def local(run_dir, *flags, env=None):
  return ["bash", "launch.sh", "local", f"--run_dir={run_dir}", *flags]


def test_local_refuses_what_would_silently_go_wrong(tmp_path):
  ckpt, tok, train, ev = real_inputs(tmp_path)
  r = run(local(tmp_path / "a", f"--init_checkpoint={ckpt}", f"--tokenizer={tok}", f"--train_jsonl={train}"))
  assert r.returncode == 2 and "needs an eval set" in r.stderr  # not the demo's arithmetic, silently
  r = run(local(tmp_path / "a", f"--train_jsonl={tmp_path / 'nope.jsonl'}", f"--eval_jsonl={ev}"))
  assert r.returncode == 2 and "nope.jsonl: no such file" in r.stderr
  r = run(local(tmp_path / "a", f"--init_checkpoint={tmp_path}", f"--eval_jsonl={ev}"))
  assert r.returncode == 2 and "no config.json" in r.stderr
  bad = tmp_path / "bad_eval.jsonl"
  bad.write_text(open(ev).read() + "{not json\n")
  r = run(local(tmp_path / "b", f"--init_checkpoint={ckpt}", f"--tokenizer={tok}", f"--train_jsonl={train}",
                f"--eval_jsonl={bad}", "--max_new_tokens=8"), timeout=300)
  assert r.returncode == 1 and "evaluation of" in r.stderr and "bad_eval.jsonl:9: invalid JSON" in r.stderr, r.stderr


def test_local_bad_train_file_stops_with_its_error_not_a_crash_loop(tmp_path):
  ckpt, tok, train, ev = real_inputs(tmp_path)
  bad = tmp_path / "bad_train.jsonl"
  bad.write_text(open(train).read() + '{"id": "x", "prompt": "1+1="}\n')  # no answer
  env = dict(benchutil.child_env(), SAME_ERROR_LIMIT="2")
  r = subprocess.run(local(tmp_path / "r", f"--init_checkpoint={ckpt}", f"--tokenizer={tok}", f"--train_jsonl={bad}",
                           "--skip_eval", "--max_new_tokens=8", "--workers=1", f"--worker_args={WORKER}"),
                     cwd=ROOT, capture_output=True, text=True, env=env, timeout=400)
  assert r.returncode == 1 and "failed 2 times with the same error" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
  assert "bad_train.jsonl:61" in r.stderr, r.stderr
  assert not os.path.exists(tmp_path / "r" / "pids" / "server.pid")  # everything stopped


def cmdline(pid):
  return open(f"/proc/{pid.strip()}/cmdline").read().split("\0")


def test_local_two_runs_side_by_side_stop_checkpoints_and_run_dir_identity(tmp_path):
  ckpt, tok, train, ev = real_inputs(tmp_path)
  real = [f"--init_checkpoint={ckpt}", f"--tokenizer={tok}", f"--train_jsonl={train}", "--skip_eval",
          "--max_new_tokens=8", f"--worker_args={WORKER}", "--workers=1", "--", *TRAIN[:-1]]
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  logs = [open(tmp_path / f"{x}.log", "w") for x in "ab"]
  pa = subprocess.Popen(local(a, "--steps=1000", *real), cwd=ROOT, env=benchutil.child_env(), stdout=logs[0],
                        stderr=subprocess.STDOUT, start_new_session=True)
  pb = subprocess.Popen(local(b, "--steps=2", *real), cwd=ROOT, env=benchutil.child_env(), stdout=logs[1],
                        stderr=subprocess.STDOUT, start_new_session=True)
  try:
    assert pb.wait(timeout=400) == 0, open(tmp_path / "b.log").read()[-3000:]
    assert open(os.path.join(b, "DONE")).read() == "2"
    ports = [dict(l.split("=") for l in open(os.path.join(d, "ports")).read().split()) for d in (a, b)]
    assert ports[0]["server"] != ports[1]["server"]
    t0 = time.time()
    while steps_done(a) < 2:
      assert pa.poll() is None and time.time() - t0 < 300, open(tmp_path / "a.log").read()[-3000:]
      time.sleep(0.5)
    trainer = cmdline(open(os.path.join(a, "pids", "trainer0.pid")).read())
    assert "--lr=1e-6" in trainer and "--dynamic_sampling" not in trainer  # real-model defaults, not the demo's
    stop = run(["bash", "launch.sh", "stop", f"--run_dir={a}"], timeout=200)
    assert stop.returncode == 0
    assert pa.wait(timeout=60) == 0
  finally:
    for p, d in ((pa, a), (pb, b)):
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        kill_roles(d)
  out = open(tmp_path / "a.log").read()
  assert "stopped before the last step" in out, out[-2000:]
  # the final checkpoint holds the last trained step (SIGTERM checkpoint, written while the server still ran)
  last = steps_done(a)
  ckpts = sorted(d for d in os.listdir(os.path.join(a, "ckpt")) if d.isdigit())
  assert int(ckpts[-1]) == last, (ckpts, last)
  assert not [f for f in os.listdir(os.path.join(a, "pids"))]
  # the same run dir with other data is refused, naming what differs
  r = run(local(a, f"--init_checkpoint={ckpt}", f"--tokenizer={tok}", f"--train_jsonl={ev}", "--skip_eval",
                "--max_new_tokens=8"))
  assert r.returncode == 2 and "holds another run" in r.stderr and "train_jsonl" in r.stderr, r.stderr

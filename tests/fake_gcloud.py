"""A fake `gcloud` for testing launch.sh's pod launcher on one machine (tests/test_launch.py puts it on PATH).

Each TPU host is a directory $FAKE_GCLOUD_ROOT/hosts/<node>/w<i>; `tpu-vm ssh --worker=i --command=C` runs
`bash -c C` there as that host (HOME = the host dir, its own env), so launch.sh's remote commands really run:
project copy, setup, supervisors, server, a multi-process trainer, workers. Supported (what launch.sh uses):

  compute tpus tpu-vm create NAME --accelerator-type=T --version=V    compute tpus tpu-vm delete NAME
  compute tpus tpu-vm describe NAME --format=value(F,...)              compute tpus tpu-vm scp [--recurse] SRC NAME:DST
  compute tpus tpu-vm ssh NAME --worker=all|i --command=C
  compute tpus queued-resources create QR --node-id=NAME --accelerator-type=T --runtime-version=V [--spot]
  compute tpus queued-resources describe QR --format=...               compute tpus queued-resources delete QR
  compute instances create NAME --machine-type=T --image-family=F --image-project=P
          [--provisioning-model=SPOT [--instance-termination-action=STOP|DELETE]]
  compute instances describe NAME --format=value(F,...)                compute instances delete NAME
  compute ssh NAME --command=C                                         compute scp [--recurse] SRC NAME:DST

Like the real one it refuses an accelerator type or runtime version the Cloud TPU docs do not list (or a runtime of
another generation), and a slice has the documented number of workers: both from tests/tpu_types.json, written
from the docs independently of launch.sh's table; a Compute Engine VM (one host) likewise needs a documented machine
type and an image family of its image project. Every call's argv is appended to calls.jsonl (tests check, e.g.,
that no secret is on a command line). `preempt(root, name)` plays the cloud: kills the node's or VM's processes and
marks the node PREEMPTED / its queued resource SUSPENDED, or does the Spot VM's termination action (DELETE: the VM
is gone; STOP: TERMINATED).
"""
import json
import os
import shutil
import signal
import subprocess
import sys

ROOT = os.environ.get("FAKE_GCLOUD_ROOT", "")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu_types.json")) as _f:
  TYPES = json.load(_f)


def workers(accel, runtime=None):
  """The documented number of TPU VMs of ACCEL; ValueError for a type, or a runtime for it, the docs do not list."""
  family = TYPES["accelerator_types"].get(accel.rsplit("-", 1)[0], {"workers": {}})
  if accel not in family["workers"]:
    raise ValueError(f"INVALID_ARGUMENT: unknown accelerator type {accel!r}")
  if runtime is not None and TYPES["runtime_versions"]["for"].get(runtime) != accel.rsplit("-", 1)[0]:
    raise ValueError(f"INVALID_ARGUMENT: runtime version {runtime!r} is not a documented runtime for {accel}")
  return family["workers"][accel]


def _path(*parts):
  return os.path.join(ROOT, *parts)


def _load(kind, name):
  try:
    with open(_path(kind, name + ".json")) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def _save(kind, name, rec):
  os.makedirs(_path(kind), exist_ok=True)
  with open(_path(kind, name + ".json"), "w") as f:
    json.dump(rec, f)


def host_dirs(node):
  rec = _load("nodes", node) or _load("instances", node)
  if rec is None:
    sys.exit(f"fake gcloud: no TPU node or VM {node}")
  return [_path("hosts", node, f"w{i}") for i in range(rec["hosts"])]


def _kill_node(node):
  for d in (host_dirs(node) if _load("nodes", node) or _load("instances", node) else []):
    try:
      pgids = [int(x) for x in open(os.path.join(d, ".pgids")).read().split()]
    except FileNotFoundError:
      pgids = []
    for pg in pgids:
      try:
        os.killpg(pg, signal.SIGKILL)
      except OSError:
        pass


def preempt(root, node):
  """What a spot preemption does: every process on the node dies, the node is PREEMPTED."""
  global ROOT
  ROOT = root
  _kill_node(node)
  vm = _load("instances", node)
  if vm and vm.get("termination") == "DELETE":
    _delete(node, "instances")
  elif vm:
    vm["state"] = "TERMINATED"
    _save("instances", node, vm)
  if vm:
    return
  rec = _load("nodes", node)
  rec["state"] = "PREEMPTED"
  _save("nodes", node, rec)
  qr = _load("qr", node + "-qr")
  if qr:
    qr["state"] = "SUSPENDED"
    _save("qr", node + "-qr", qr)


def _create_node(node, accel, runtime):
  hosts = workers(accel, runtime)
  if _load("nodes", node):
    raise ValueError(f"ALREADY_EXISTS: node {node}")
  shutil.rmtree(_path("hosts", node), ignore_errors=True)
  _save("nodes", node, dict(accel=accel, state="READY", hosts=hosts))
  for d in host_dirs(node):
    os.makedirs(d)


def _opts(args):
  pos, kv, flags = [], {}, set()
  for a in args:
    if a.startswith("--") and "=" in a:
      k, v = a[2:].split("=", 1)
      kv[k] = v
    elif a.startswith("--"):
      flags.add(a[2:])
    else:
      pos.append(a)
  return pos, kv, flags


def _host_env(d, i):
  env = dict(os.environ, HOME=d, TPU_WORKER_ID=str(i))
  env.update(json.loads(os.environ.get("FAKE_GCLOUD_HOST_ENV", "{}")))
  return env


def _ssh(node, worker, command):
  dirs = host_dirs(node)
  idx = range(len(dirs)) if worker == "all" else [int(worker)]
  rc = 0
  for i in idx:
    # Own session per ssh command: what it leaves running (nohup ... &) is this host's, killable by preempt().
    p = subprocess.Popen(["bash", "-c", command], cwd=dirs[i], env=_host_env(dirs[i], i), start_new_session=True,
                         stdin=subprocess.DEVNULL)
    with open(os.path.join(dirs[i], ".pgids"), "a") as f:
      f.write(f"{p.pid}\n")
    rc = p.wait() or rc
  return rc


def _scp(src, dst):
  node, rel = dst.split(":", 1)
  for d in host_dirs(node):
    out = os.path.join(d, rel)
    os.makedirs(os.path.dirname(out) or d, exist_ok=True)
    if os.path.isdir(src):
      shutil.copytree(src, out, dirs_exist_ok=True)
    else:
      shutil.copy2(src, out)
  return 0


def _describe(rec, fmt):
  """--format=value(F,...): the fields tab-separated, as gcloud prints them."""
  if rec is None:
    return 1
  known = {"state": rec.get("state"), "state.state": rec.get("state"), "acceleratorType": rec.get("accel"),
           "networkEndpoints[0].ipAddress": "127.0.0.1", "status": rec.get("state"),
           "machineType.basename()": rec.get("machineType", "").rsplit("/", 1)[-1]}
  print("\t".join(known[f] for f in fmt[len("value("):-1].split(",")))
  return 0


def _create_vm(name, kv, flags):
  ce = TYPES["compute_engine"]
  if kv["machine-type"] not in ce["machine_types"]:
    raise ValueError(f"Invalid value for field 'resource.machineType': {kv['machine-type']!r}. Machine type with name "
                     f"{kv['machine-type']!r} does not exist in zone")
  if ce["image_families"].get(kv["image-family"]) != kv["image-project"]:
    raise ValueError(f"The resource 'projects/{kv['image-project']}/global/images/family/{kv['image-family']}' "
                     "was not found")
  if "instance-termination-action" in kv and kv.get("provisioning-model") != "SPOT":
    raise ValueError("--instance-termination-action is only for --provisioning-model=SPOT")
  if _load("instances", name):
    raise ValueError(f"The resource 'projects/p/zones/z/instances/{name}' already exists")
  shutil.rmtree(_path("hosts", name), ignore_errors=True)
  termination = kv.get("instance-termination-action", "STOP") if kv.get("provisioning-model") == "SPOT" else None
  _save("instances", name, dict(state="RUNNING", hosts=1, termination=termination,
                                machineType=f"https://www.googleapis.com/compute/v1/projects/p/zones/z/machineTypes/"
                                            f"{kv['machine-type']}"))
  os.makedirs(_path("hosts", name, "w0"))


def _delete(name, kind="nodes"):
  if _load(kind, name) is None:
    return 1
  _kill_node(name)
  shutil.rmtree(_path("hosts", name), ignore_errors=True)
  os.remove(_path(kind, name + ".json"))
  return 0


def main(argv):
  with open(_path("calls.jsonl"), "a") as f:
    f.write(json.dumps(argv) + "\n")
  if argv[:2] == ["compute", "tpus"] and argv[2] in ("tpu-vm", "queued-resources"):
    group, (pos, kv, flags) = argv[2], _opts(argv[3:])
    verb, rest, what = pos[0], pos[1:], f"compute.tpus.{argv[2]}.{pos[0]}"
  elif argv[:2] == ["compute", "instances"] or argv[:2] in (["compute", "ssh"], ["compute", "scp"]):
    at = 2 if argv[1] == "instances" else 1  # compute instances VERB ... / compute ssh|scp ...
    group, verb, (rest, kv, flags) = "vm", argv[at], _opts(argv[at + 1:])
    what = ".".join(argv[:at + 1])
  else:
    sys.exit(f"fake gcloud: unsupported {argv}")
  try:
    return _run(group, verb, rest, kv, flags)
  except ValueError as e:
    sys.exit(f"ERROR: (gcloud.{what}) {e}")
  except KeyError as e:
    sys.exit(f"ERROR: (gcloud.{what}) argument --{e.args[0]}: Must be specified.")


def _run(group, verb, rest, kv, flags):
  if group == "vm":
    if verb == "create":
      _create_vm(rest[0], kv, flags)
      return 0
    if verb == "delete":
      return _delete(rest[0], "instances")
    if verb == "describe":
      rec = _load("instances", rest[0])
      if rec is None:
        print(f"ERROR: (gcloud.compute.instances.describe) Could not fetch resource:\n - The resource "
              f"'projects/p/zones/z/instances/{rest[0]}' was not found", file=sys.stderr)
      return _describe(rec, kv.get("format", ""))
    if verb in ("ssh", "scp"):
      name = rest[0] if verb == "ssh" else rest[1].split(":", 1)[0]
      if (_load("instances", name) or {}).get("state") != "RUNNING":
        raise ValueError(f"instance {name} is not running")
      return _ssh(name, "0", kv["command"]) if verb == "ssh" else _scp(rest[0], rest[1])
  elif group == "tpu-vm":
    if verb == "create":
      _create_node(rest[0], kv["accelerator-type"], kv["version"])
      return 0
    if verb == "delete":
      return _delete(rest[0])
    if verb == "describe":
      return _describe(_load("nodes", rest[0]), kv.get("format", ""))
    if verb == "ssh":
      return _ssh(rest[0], kv.get("worker", "0"), kv["command"])
    if verb == "scp":
      return _scp(rest[0], rest[1])
  else:
    qr = rest[0]
    if verb == "create":
      if _load("qr", qr):
        raise ValueError(f"ALREADY_EXISTS: queued resource {qr}")
      _create_node(kv["node-id"], kv["accelerator-type"], kv["runtime-version"])
      _save("qr", qr, dict(node=kv["node-id"], state="ACTIVE", spot="spot" in flags))
      return 0
    if verb == "describe":
      return _describe(_load("qr", qr), kv.get("format", ""))
    if verb == "delete":
      rec = _load("qr", qr)
      if rec is None:
        return 1
      _delete(rec["node"])
      os.remove(_path("qr", qr + ".json"))
      return 0
  sys.exit(f"fake gcloud: unsupported {group} {verb}")


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""The code sandbox: `run_code(code, tests, limits) -> CodeResult`. Tests: python source strings (asserts run
after the program, in its namespace) or {"input": stdin, "output": expected stdout} cases (the program re-run per
case; lines compared after stripping trailing whitespace; SystemExit(0) is a normal end), never both kinds.

A fresh `python -I -S` child in its own session and temp dir gets its spec (code, test inputs or asserts, a
per-run nonce) on a pipe, then fd 0 becomes /dev/null, so the spec cannot be re-read. Expected outputs never reach
it: it sends back a nonce-tagged sha256 of each test's normalised output and the PARENT judges, so `os._exit(0)`
or forged lines fail. Before candidate code runs the child sets rlimits (CPU, AS, FSIZE, NOFILE, CORE=0), unshares
its network namespace when the kernel allows, drops root to uid 65534 (after pre-importing the usual stdlib: the
interpreter may sit in an unreadable home dir), sets RLIMIT_NPROC=0, deletes the calls no audit event covers
(mkfifo, mknod, _imp.create_dynamic) and installs an audit hook that denies files outside the temp dir (reads
also under the Python prefixes), directory fds, more than `max_files` writes, fork/exec/subprocess/kill,
sockets, ctypes, frame and gc introspection. The parent kills the process group at the wall-time limit.

NOT a kernel-level boundary: the audit hook is in-process Python, so hostile native code (a CPython memory bug)
gets past it, leaving rlimits, the uid drop and the net namespace; at scale run the verifier in a container /
gVisor / nsjail (docs/GUIDE.md). Assert tests trust the candidate's `__eq__`: prefer io tests for rewards.
tests/test_data.py::test_code_known_tricks_score_zero tries each known trick.
"""
import dataclasses
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  wall_s: float = 10.0          # whole-process-group kill after this
  cpu_s: int = 5                # RLIMIT_CPU (SIGXCPU)
  mem_mb: int = 512             # RLIMIT_AS
  output_bytes: int = 1 << 20   # RLIMIT_FSIZE and the captured-output cap per test
  max_files: int = 32           # disk quota: write-opens + mkdirs per run, so disk use <= (max_files+3) * output_bytes
  audit_hook: bool = True       # False only to test the OS-level layers on their own


@dataclasses.dataclass(frozen=True)
class CodeResult:
  passed: bool
  reason: str        # "ok", "failed", "timeout", "killed by signal N", "exit N"
  stderr: str        # tail of the child's stderr, for debugging
  sandbox: str       # what the child managed to set up, e.g. "net=unshared uid=65534"


# Runs inside the sandboxed child as `python -I -c _RUNNER`. Everything it needs after user code starts is
# bound to locals first, so user code cannot monkeypatch the checker (it cannot reach frames or gc either).
_RUNNER = r"""
def _main():
  import sys, os, io, json, resource, hashlib
  # The spec arrives on a pipe (unseekable) and fd 0 becomes /dev/null before any candidate code runs: the
  # candidate cannot re-read its spec. Expected outputs are never in it (the parent compares hashes).
  spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
  null = os.open("/dev/null", os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  nonce, lim, result_fd, work = spec["nonce"], spec["limits"], spec["result_fd"], os.getcwd()
  status = []
  setr = resource.setrlimit
  setr(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
  setr(resource.RLIMIT_AS, (lim["mem_mb"] << 20, lim["mem_mb"] << 20))
  setr(resource.RLIMIT_FSIZE, (lim["output_bytes"], lim["output_bytes"]))
  setr(resource.RLIMIT_CORE, (0, 0))
  setr(resource.RLIMIT_NOFILE, (64, 64))
  root = os.geteuid() == 0
  try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    flags = 0x40000000 if root else 0x40000000 | 0x10000000  # CLONE_NEWNET (| CLONE_NEWUSER unprivileged)
    status.append("net=unshared" if libc.unshare(flags) == 0 else "net=shared")
  except Exception:
    status.append("net=shared")
  # The usual stdlib is imported now: the interpreter may sit in a home dir nobody cannot read (root drops to
  # 65534 below), and extension modules cannot load once _imp.create_dynamic is gone (below).
  for m in ("math cmath re collections itertools functools heapq bisect string random fractions decimal statistics "
            "typing dataclasses copy operator array datetime textwrap unicodedata enum abc numbers struct time").split():
    try:
      __import__(m)
    except Exception:
      pass
  if root:
    os.chown(work, 65534, 65534)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
  status.append(f"uid={os.getuid()}")
  try:  # die with the verifier process (e.g. a pool worker killed on timeout); set after setuid, which clears it
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
  except Exception:
    pass
  if os.getppid() != spec["ppid"]:
    os._exit(3)  # the parent already died before prctl took effect
  setr(resource.RLIMIT_NPROC, (0, 0))  # no fork, no threads (enforced for non-root uids)
  for m in ("ctypes", "_ctypes", "ctypes._endian"):
    sys.modules.pop(m, None)
  # Calls the audit hook cannot see (no audit event): removed from the module objects themselves.
  import posix, _imp
  for mod, names in ((os, ("mkfifo", "mknod")), (posix, ("mkfifo", "mknod")), (_imp, ("create_dynamic",))):
    for n in names:
      if hasattr(mod, n):
        delattr(mod, n)
  os.write(result_fd, (" ".join(status) + "\n").encode())
  isinstance_, str_, bytes_, int_, isdir = isinstance, str, bytes, int, os.path.isdir
  if lim["audit_hook"]:
    prefixes = tuple(sorted({os.path.realpath(p) + os.sep for p in
                             (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}))
    work_sep, realpath = work + os.sep, os.path.realpath
    deny_prefix = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.kill",
                   "os.killpg", "os.chdir", "os.chroot", "subprocess.", "socket.", "ctypes.", "sys._getframe",
                   "sys._current_frames", "gc.", "object.__getattr__", "object.__setattr__", "object.__delattr__",
                   "sys.setprofile", "sys.settrace", "pty.", "winreg.", "mmap.", "signal.", "os.fchdir")
    blocked_imports = ("ctypes", "_ctypes", "_posixsubprocess", "subprocess", "multiprocessing", "_multiprocessing",
                       "socket", "_socket", "ssl", "pty", "gc", "_imp")
    path_events = ("os.listdir", "os.scandir", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod",
                   "os.chown", "os.truncate", "os.utime", "os.link", "os.symlink", "shutil.rmtree", "os.chflags")
    creates = [0]  # disk quota: at most max_files write-opens/mkdirs, each capped by RLIMIT_FSIZE
    def inside(p, read):
      if isinstance_(p, int_):
        return True  # inherited fds only (0,1,2 and the result fd)
      if isinstance_(p, bytes_):
        p = p.decode("utf-8", "replace")
      rp = realpath(str_(p)) + "/"
      return rp.startswith(work_sep) or (read and (rp.startswith(prefixes) or rp == "/dev/null/"))
    def count_create():
      creates[0] += 1
      if creates[0] > lim["max_files"]:
        raise PermissionError(f"sandbox: more than {lim['max_files']} files written (disk quota)")
    def hook(event, args):
      if event == "open":
        if isinstance_(args[1], str_):  # open()/io.open_code: a mode string
          read_only = "r" in args[1] and "+" not in args[1]
        else:  # os.open: flags; read-only means O_RDONLY without O_CREAT/O_TRUNC
          # A directory fd would let dir_fd= paths (checked here against the cwd) escape: no directory fds.
          if args[2] & os.O_DIRECTORY or (not isinstance_(args[0], int_) and isdir(args[0])):
            raise PermissionError(f"sandbox: os.open of a directory ({args[0]!r}) is blocked")
          read_only = (args[2] & 3) == 0 and not args[2] & (os.O_CREAT | os.O_TRUNC)
        if not inside(args[0], read=read_only):
          raise PermissionError(f"sandbox: open({args[0]!r}) outside the work dir")
        if not read_only:
          count_create()
      elif event in path_events:
        for a in args[:2]:
          if isinstance_(a, (str_, bytes_)) and not inside(a, read=False):
            raise PermissionError(f"sandbox: {event}({a!r}) outside the work dir")
        if event in ("os.mkdir", "os.symlink", "os.link"):
          count_create()
      elif event == "import":
        if args[0].split(".")[0] in blocked_imports:
          raise ImportError(f"sandbox: import {args[0]} is blocked")
      elif event.startswith(deny_prefix):
        raise PermissionError(f"sandbox: {event} is blocked")
    sys.addaudithook(hook)
  code, tests, io_mode = spec["code"], spec["tests"], spec["io"]
  del spec
  exec_, compile_, TextIOWrapper, BytesIO, BaseException_, SystemExit_ = exec, compile, io.TextIOWrapper, io.BytesIO, BaseException, SystemExit
  cap, write, stdin0, stdout0, sha = lim["output_bytes"], os.write, sys.stdin, sys.stdout, hashlib.sha256
  norm = lambda s: "\n".join(ln.rstrip() for ln in s.rstrip().splitlines())
  ok = True
  try:
    prog = compile_(code, "solution.py", "exec")
    if not io_mode:
      g = {"__name__": "__main__"}
      exec_(prog, g)
      for t in tests:
        exec_(compile_(t, "test.py", "exec"), g)
    else:
      for i, t in enumerate(tests):
        buf = BytesIO()
        sys.stdin = TextIOWrapper(BytesIO(t.encode("utf-8")), encoding="utf-8")
        sys.stdout = out = TextIOWrapper(buf, encoding="utf-8", write_through=True)
        try:
          exec_(prog, {"__name__": "__main__"})
        except SystemExit_ as e:
          if e.code not in (None, 0):
            raise
        out.flush()
        got = buf.getvalue()
        sys.stdin, sys.stdout = stdin0, stdout0
        if len(got) > cap:
          ok = False
          break
        # Only a hash of this test's output goes back; the parent holds the expected output and judges.
        write(result_fd, f"{nonce} out {i} {sha(norm(got.decode('utf-8', 'replace')).encode()).hexdigest()}\n".encode())
  except BaseException_ as e:
    ok = False
    sys.stdin, sys.stdout = stdin0, stdout0
    try:
      sys.stderr.write(f"{type(e).__name__}: {e}\n"[:2000])
    except BaseException_:
      pass
  if ok:
    write(result_fd, f"{nonce} done\n".encode())
_main()
"""


def _norm_output(s: str) -> str:
  return "\n".join(ln.rstrip() for ln in s.rstrip().splitlines())  # the same rule as the child's `norm`


def _judge(lines, nonce, tests) -> bool:
  """The parent's verdict from the child's result lines. Only lines carrying the nonce count (the candidate
  never sees it); io outputs are compared here, against expected outputs the child never received."""
  mine = [ln.split(" ")[1:] for ln in lines if ln.startswith(nonce + " ")]
  if ["done"] not in mine:
    return False
  if all(isinstance(t, str) for t in tests):
    return True
  got = {int(m[1]): m[2] for m in mine if len(m) == 3 and m[0] == "out" and m[1].isdigit()}
  return all(got.get(i) == hashlib.sha256(_norm_output(t[1]).encode()).hexdigest() for i, t in enumerate(tests))


def run_code(code: str, tests, limits: SandboxLimits = SandboxLimits()) -> CodeResult:
  """Runs `code` against `tests` in the sandbox described in the module docstring. Never raises for
  anything the program does; returns within about limits.wall_s."""
  tests = [t if isinstance(t, str) else tuple(t) for t in (tests or ())]
  if not tests:
    raise ValueError("run_code: no tests given")
  io_mode = not all(isinstance(t, str) for t in tests)
  if io_mode and any(isinstance(t, str) for t in tests):
    raise ValueError("run_code: tests mix assert strings with input/output cases; use one kind")
  with tempfile.TemporaryDirectory(prefix="rlax-code-") as root:
    os.chmod(root, 0o711)  # the child may drop to uid 65534 and must still reach work/
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    nonce = secrets.token_hex(16)
    # stdout/stderr go to files so RLIMIT_FSIZE kills a flood at once (a pipe could fill, /dev/null never would).
    with open(os.path.join(root, "result"), "w+b") as res, open(os.path.join(root, "stderr"), "w+b") as err, \
        open(os.path.join(root, "stdout"), "wb") as out:
      spec = {"nonce": nonce, "code": code, "tests": [t[0] if io_mode else t for t in tests], "io": io_mode,
              "result_fd": res.fileno(), "ppid": os.getpid(), "limits": dataclasses.asdict(limits)}
      env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "PYTHONHASHSEED": "0",
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
      # -I: no env vars, no user site; -S: no site-packages on sys.path and no .pth processing.
      proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _RUNNER], cwd=work, stdin=subprocess.PIPE,
                              stdout=out, stderr=err, env=env, close_fds=True,
                              pass_fds=(res.fileno(),), start_new_session=True)
      try:
        proc.communicate(json.dumps(spec).encode(), timeout=limits.wall_s)
        rc = proc.returncode
        reason = "ok" if rc == 0 else f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session/process group, before reaping
        proc.wait()
        rc, reason = None, "timeout"
      res.seek(0)
      lines = res.read(1 << 20).decode("utf-8", "replace").split("\n")
      err.seek(0)
      stderr = err.read(limits.output_bytes).decode("utf-8", "replace")[-2000:]
    passed = rc == 0 and _judge(lines[1:], nonce, tests)
    if reason == "ok" and not passed:
      reason = "failed"
    return CodeResult(passed, reason, stderr, lines[0] if lines else "")

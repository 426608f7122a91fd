"""The code sandbox: `run_code(code, tests, limits) -> CodeResult`.

Isolation is the kernel's, through bubblewrap (`bwrap`, Debian's `bubblewrap`: Flatpak's sandbox, one small binary
that sets up namespaces, mounts, no_new_privs and the capability drop correctly; `unshare` plus our own mount code
would re-implement it, less well; launch.sh installs it). Each run is a fresh `python -I -S` in its own pid, mount,
network, ipc and uts namespaces (and a user namespace when the verifier is not root), uid 65534 with no
capabilities, in a new session, killed with its parent. It sees a read-only /usr and interpreter prefix, a /proc of
its own pid namespace (only its own processes: a group-mate scored beside it is invisible, so it cannot be
signalled), a minimal /dev, loopback only, and one empty writable tmpfs of `disk_mb`; no other host file exists
for it. Rlimits (CPU, address space, file size, open files, NPROC=0: no fork, no threads) bound it, and the parent
kills its process group at the wall-time limit.

The harness the candidate cannot touch. The child receives the program and the test INPUTS only: stdin text for
io tests, the expression `add(1, 2)` for the call test `assert add(1, 2) == 3`; expected values never enter it. It
returns plain data: a hash of each io test's stdout, or `repr` of each call's result when the result is built of
exact builtin types only (int, float, complex, str, bytes, bool, None, and lists, tuples, sets, dicts of them: no
subclass, no custom `__eq__`; anything else fails the test). The parent, an interpreter the candidate never runs in,
judges with `ast.literal_eval` and `==` on those plain values. A result line repeated for a test fails it, so lines
the candidate writes itself cannot win. Contract for task authors: a test is either {"input", "output"} (stdout
compared after stripping trailing whitespace per line; SystemExit(0) is a normal end) or a string
`assert EXPR == LITERAL` (either side may be the literal); any other string is refused with a ValueError.

Without bwrap, run_code raises SandboxUnavailable unless limits.unsafe (rlimits only: trusted code, no isolation).
tests/test_sandbox.py tries every known attack.
"""
import ast
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
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
  disk_mb: int = 16             # size of the writable tmpfs
  unsafe: bool = False          # True: run without bwrap (no isolation; trusted code only)


@dataclasses.dataclass(frozen=True)
class CodeResult:
  passed: bool
  reason: str        # "ok", "failed", "timeout", "killed by signal N", "exit N"
  stderr: str        # tail of the child's stderr, for debugging


class SandboxUnavailable(RuntimeError):
  pass


def call_test(src: str):
  """`assert EXPR == LITERAL` (either side the literal) -> (EXPR source, the literal's value); else ValueError."""
  try:
    body = ast.parse(src).body
  except SyntaxError as e:
    raise ValueError(f"test {src!r:.80}: not python ({e.msg})") from None
  node = body[0].test if len(body) == 1 and isinstance(body[0], ast.Assert) else None
  if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
    for expr, lit in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
      try:
        return ast.unparse(expr), ast.literal_eval(lit)
      except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
  raise ValueError(f"test {src!r:.80}: a string test must read 'assert EXPR == LITERAL' (tasks/sandbox.py)")


# Runs inside the sandbox as `python -I -S -c _RUNNER`; the spec (program, test inputs, nonce) comes on fd 0, which
# then becomes /dev/null. Everything the harness uses after candidate code starts is bound to locals first.
_RUNNER = r"""
def _main():
  import sys, os, io, json, resource, hashlib
  spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
  null = os.open("/dev/null", os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  lim, fd, nonce = spec["limits"], spec["result_fd"], spec["nonce"]
  for r, v in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["mem_mb"] << 20),
               (resource.RLIMIT_FSIZE, lim["output_bytes"]), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64)):
    resource.setrlimit(r, (v, v))
  if os.geteuid() == 0 and not lim["unsafe"]:  # bwrap run by root kept CAP_SETUID/SETGID for this drop only
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)  # from 0 to non-zero: every capability is gone
  if not lim["unsafe"]:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no fork, no threads (enforced for non-root uids)
  type_, list_, tuple_, set_, dict_, all_, repr_, len_ = type, list, tuple, set, dict, all, repr, len
  write, sha, exec_, eval_, compile_ = os.write, hashlib.sha256, exec, eval, compile
  TextIOWrapper, BytesIO, BaseException_, SystemExit_ = io.TextIOWrapper, io.BytesIO, BaseException, SystemExit
  atoms, seqs, cap = (int, float, complex, str, bytes, bool, type(None)), (list, tuple, set, frozenset), lim["output_bytes"]
  def plain(v, depth=0):  # exact builtin types only: comparing or printing them runs no candidate code
    t = type_(v)
    if t in atoms:
      return True
    if depth > 20:
      return False
    if t in seqs:
      return all_(plain(x, depth + 1) for x in v)
    return t is dict_ and all_(plain(k, depth + 1) and plain(x, depth + 1) for k, x in v.items())
  def send(i, payload):
    write(fd, (nonce + " " + json.dumps([i, payload]) + "\n").encode())
  stdin0, stdout0 = sys.stdin, sys.stdout
  try:
    prog = compile_(spec["code"], "solution.py", "exec")
    if not spec["io"]:
      g = {"__name__": "__main__"}
      exec_(prog, g)
      for i, expr in enumerate(spec["inputs"]):
        v = eval_(compile_(expr, "test.py", "eval"), g)
        s = repr_(v) if plain(v) else None
        send(i, s if s is not None and len_(s) <= cap else None)
    else:
      for i, text in enumerate(spec["inputs"]):
        buf = BytesIO()
        sys.stdin = TextIOWrapper(BytesIO(text.encode("utf-8")), encoding="utf-8")
        sys.stdout = out = TextIOWrapper(buf, encoding="utf-8", write_through=True)
        try:
          exec_(prog, {"__name__": "__main__"})
        except SystemExit_ as e:
          if e.code not in (None, 0):
            raise
        out.flush()
        sys.stdin, sys.stdout = stdin0, stdout0
        got = buf.getvalue()
        norm = "\n".join(ln.rstrip() for ln in got.decode("utf-8", "replace").rstrip().splitlines())
        send(i, sha(norm.encode()).hexdigest() if len_(got) <= cap else None)
  except BaseException_ as e:
    sys.stdin, sys.stdout = stdin0, stdout0
    try:
      sys.stderr.write(f"{type(e).__name__}: {e}\n"[:2000])
    except BaseException_:
      pass
_main()
"""


def _norm_output(s: str) -> str:
  return "\n".join(ln.rstrip() for ln in s.rstrip().splitlines())  # the same rule as the child's


def _judge(lines, nonce, expected, io_mode) -> bool:
  got = {}
  for ln in lines:
    if not ln.startswith(nonce + " "):
      continue
    try:
      i, payload = json.loads(ln[len(nonce) + 1:])
    except (ValueError, TypeError):
      return False
    if i in got:  # a second line for a test: forged
      return False
    got[i] = payload
  for i, want in enumerate(expected):
    v = got.get(i)
    if not isinstance(v, str):
      return False
    if io_mode:
      ok = v == hashlib.sha256(_norm_output(want).encode()).hexdigest()
    else:
      try:
        ok = ast.literal_eval(v) == want
      except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        ok = False
    if not ok:
      return False
  return True


def _bwrap_argv(bwrap, limits):
  """bwrap's arguments: namespaces, then a filesystem of read-only /usr + interpreter and one writable tmpfs."""
  argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
          "--die-with-parent", "--new-session", "--clearenv", "--ro-bind", "/usr", "/usr", "--proc", "/proc",
          "--dev", "/dev", "--perms", "1777", "--size", str(limits.disk_mb << 20), "--tmpfs", "/work",
          "--chdir", "/work", "--setenv", "HOME", "/work", "--setenv", "LANG", "C.UTF-8"]
  if os.geteuid() == 0:  # no user namespace: the runner drops to uid 65534 itself, so NPROC applies to it
    argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
  else:
    argv += ["--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"]
  for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # merged-/usr symlinks, or real dirs on older systems
    if os.path.islink(d):
      argv += ["--symlink", os.readlink(d), d]
    elif os.path.isdir(d):
      argv += ["--ro-bind", d, d]
  for p in sorted({os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))}):
    if p == "/usr" or p.startswith("/usr/"):
      continue
    parts = p.strip("/").split("/")
    for k in range(1, len(parts)):  # parents 0755, so uid 65534 can reach an interpreter under /root
      argv += ["--perms", "0755", "--dir", "/" + "/".join(parts[:k])]
    argv += ["--ro-bind", p, p]
  return argv


def run_code(code: str, tests, limits: SandboxLimits = SandboxLimits()) -> CodeResult:
  """Runs `code` against `tests` (see the module docstring) and returns within about limits.wall_s. Raises only
  for bad tests (ValueError) or a missing bwrap (SandboxUnavailable); nothing the program does raises."""
  tests = [t if isinstance(t, str) else tuple(t) for t in (tests or ())]
  if not tests:
    raise ValueError("run_code: no tests given")
  io_mode = not all(isinstance(t, str) for t in tests)
  if io_mode and any(isinstance(t, str) for t in tests):
    raise ValueError("run_code: tests mix assert strings with input/output cases; use one kind")
  inputs, expected = zip(*(t if io_mode else call_test(t) for t in tests))
  bwrap = shutil.which("bwrap")
  if not bwrap and not limits.unsafe:
    raise SandboxUnavailable("code sandbox: bubblewrap (bwrap) is not installed (apt-get install bubblewrap; "
                             "launch.sh does this); refusing to run untrusted code without it")
  with tempfile.TemporaryDirectory(prefix="rlax-code-") as tmp:
    nonce = secrets.token_hex(16)
    # stdout/stderr go to files so RLIMIT_FSIZE kills a flood at once (a pipe could fill, /dev/null never would).
    with open(os.path.join(tmp, "result"), "w+b") as res, open(os.path.join(tmp, "stderr"), "w+b") as err, \
        open(os.path.join(tmp, "stdout"), "wb") as out:
      spec = {"nonce": nonce, "code": code, "inputs": list(inputs), "io": io_mode, "result_fd": res.fileno(),
              "limits": dataclasses.asdict(limits)}
      py = [os.path.realpath(sys.executable), "-I", "-S", "-c", _RUNNER]
      argv = py if limits.unsafe else _bwrap_argv(bwrap, limits) + py
      proc = subprocess.Popen(argv, cwd=tmp, stdin=subprocess.PIPE, stdout=out, stderr=err, close_fds=True,
                              pass_fds=(res.fileno(),), start_new_session=True,
                              env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp})
      try:
        proc.communicate(json.dumps(spec).encode(), timeout=limits.wall_s)
        rc = proc.returncode
        sig = -rc if rc < 0 else rc - 128 if rc > 128 and not limits.unsafe else 0  # bwrap reports 128 + signal
        reason = "ok" if rc == 0 else f"killed by signal {sig}" if sig else f"exit {rc}"
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session, before reaping (bwrap's pid 1 takes the rest)
        proc.wait()
        rc, reason = None, "timeout"
      res.seek(0)
      lines = res.read(len(tests) * (limits.output_bytes + 200)).decode("utf-8", "replace").split("\n")
      err.seek(0)
      stderr = err.read(limits.output_bytes).decode("utf-8", "replace")[-2000:]
    passed = rc == 0 and _judge(lines, nonce, expected, io_mode)
    return CodeResult(passed, "failed" if reason == "ok" and not passed else reason, stderr)

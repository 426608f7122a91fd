"""The code sandbox (tasks/sandbox.py) against every attack we know of: each candidate below succeeds only if its
attack works (it prints the expected output or returns the expected value only then), so each must score 0 while
the host (the secret file, the writable dirs, a sentinel process, this process's environment) is unharmed.
The attacks are the issue reports' (issues 15 and 39), written against the kernel and CPython, not our code.
Run: python -m pytest -q tests/test_sandbox.py"""
import concurrent.futures
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import data
from data import Problem
from tasks import sandbox

FAST = sandbox.SandboxLimits(wall_s=3.0, cpu_s=2, mem_mb=256, output_bytes=1 << 16, disk_mb=4)


def run(code, tests=(("", "ok"),), limits=FAST):
  return sandbox.run_code(code, tests, limits)


@pytest.fixture(scope="module")
def host():
  """What an escape would touch: a secret file, world-writable dirs (a writable site-packages stands for the
  user's venv), a sentinel process, a secret in this process's environment."""
  root = tempfile.mkdtemp(prefix="sandbox-host-")
  secret, outside, site = (os.path.join(root, n) for n in ("secret.txt", "outside", "site"))
  with open(secret, "w") as f:
    f.write("s3cret")
  for d in (outside, site):
    os.mkdir(d)
    os.chmod(d, 0o777)  # only the sandbox, not file permissions, can stop writes here
  os.chmod(root, 0o755)
  os.chmod(secret, 0o644)
  sentinel = subprocess.Popen(["sleep", "600"])
  os.environ["RLAX_SANDBOX_SECRET"] = "env-s3cret"
  yield dict(secret=secret, outside=outside, site=site, sentinel=sentinel)
  sentinel.kill()
  shutil.rmtree(root, ignore_errors=True)


def assert_unharmed(h):
  assert open(h["secret"]).read() == "s3cret"
  assert os.listdir(h["outside"]) == [] and os.listdir(h["site"]) == []
  assert h["sentinel"].poll() is None, "the sentinel process was killed"


def test_honest_programs_pass_and_wrong_ones_fail():
  r = run("print(sum(map(int, input().split())))", [("1 2\n", "3\n"), ("5 5", "10")])
  assert r.passed and r.reason == "ok", r
  assert not run("print(sum(map(int, input().split())) + 1)", [("1 2\n", "3\n")]).passed
  assert run("def f(x):\n  return 2 * x\n", ["assert f(2) == 4", "assert 0 == f(0)", "assert f(1) == (2)"]).passed
  assert run("def f(x):\n  return [x, (x, {'a': None})]", ["assert f(1) == [1, (1, {'a': None})]"]).passed
  assert not run("def f(x):\n  return 2 * x\n", ["assert f(2) == 5"]).passed
  assert not run("raise RuntimeError('crash')").passed
  assert not run("def f(:").passed  # syntax error
  assert run("open('a.txt', 'w').write('ok')\nprint(open('a.txt').read())").passed  # the work dir is writable
  assert run("import sys\nprint('ok')\nsys.exit(0)").passed  # a normal exit(0) ends an io test fine
  p = Problem("c", "?", "", "code", (("2\n", "4"),))
  assert data.verify(p, "Sure:\n```python\nprint(int(input()) ** 2)\n```\n") == 1.0
  assert data.verify(p, "print(int(input()) * 3)") == 0.0


def test_test_contract_is_checked():
  """String tests must read `assert EXPR == LITERAL`: anything else is refused (naming the test), at run time and
  when a jsonl line is loaded (naming file and line)."""
  for bad in ("assert f(1)", "assert f(1) == g(1)", "assert f(1) != 2", "x = 1", "assert f(1) == 2 == 2", "def f(:"):
    with pytest.raises(ValueError, match="test"):
      run("def f(x):\n  return x", [bad])
  with pytest.raises(ValueError, match=r"d\.jsonl:1.*assert EXPR == LITERAL"):
    data._problem_from_dict({"prompt": "?", "answer": "", "tests": ["assert f(1)"]}, "d.jsonl:1", default_id="x")


def test_exit_and_forgery_cheats_fail():
  for cheat in ("import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise SystemExit(0)"):
    assert not run("def f(x):\n  return 0\n" + cheat, ["assert f(2) == 4"]).passed, cheat
  # With the nonce read from the harness's frame, forge a result for the test, then a second for good measure.
  forge = ("import sys, os, json\nf = sys._getframe(1)\nwhile 'nonce' not in f.f_locals:\n  f = f.f_back\n"
           "L = f.f_locals\nfor v in ('4', '5'):\n  os.write(L['fd'], (L['nonce'] + ' ' + json.dumps([0, v]) + '\\n').encode())\n"
           "def f(x):\n  return 4\n")
  assert not run(forge, ["assert f(2) == 4"]).passed  # the harness's own line makes a duplicate: fails
  assert not run(forge + "os._exit(0)", ["assert f(2) == 9"]).passed  # forged lines only carry guesses


def test_objects_that_equal_anything_fail():
  tricks = {
      "always_eq": "class A:\n  def __eq__(s, o): return True\n  __hash__ = None\ndef add(a, b):\n  return A()",
      "int_subclass": "class I(int):\n  def __eq__(s, o): return True\n  __hash__ = int.__hash__\ndef add(a, b):\n  return I(0)",
      "list_of_eq": "class A:\n  def __eq__(s, o): return True\ndef add(a, b):\n  return [A()]",
      "repr_forger": "class A:\n  def __repr__(s): return '3'\ndef add(a, b):\n  return A()",
      "patched_builtins": ("import builtins\nbuiltins.type = lambda x: int\nbuiltins.repr = lambda x: '3'\n"
                           "class A:\n  def __eq__(s, o): return True\ndef add(a, b):\n  return A()"),
      "replaced___builtins__": ("class B(dict):\n  def __getitem__(s, k): return (lambda *a: True)\n"
                                "__builtins__ = B()\ndef add(a, b):\n  return 0"),
  }
  for name, code in tricks.items():
    r = run(code, ["assert add(1, 2) == 3", "assert add(2, 2) == 4"])
    assert not r.passed, (name, r)
    print(f"| {name} | scores 0 ({r.reason}) |")


def test_reading_the_tests_gets_no_answers():
  """The candidate sees the test source through audit events, its frames and fd 0: it holds inputs only."""
  spy = ("import sys, re\nseen = []\nsys.addaudithook(lambda e, a: seen.append(str(a[0])) if e == 'compile' else None)\n"
         "def add(a, b):\n  nums = [int(x) for s in seen for x in re.findall(r'==\\s*(\\d+)', s)]\n"
         "  return nums[-1] if nums else -1\n")
  assert not run(spy, ["assert add(1, 2) == 3"]).passed
  frames = ("import sys\ndef add(a, b):\n  f = sys._getframe(1)\n  while f and 'spec' not in f.f_locals:\n    f = f.f_back\n"
            "  return f and str(f.f_locals.get('spec'))\n")
  assert not run(frames, ["assert add(1, 2) == 3"]).passed
  # fd 0 was the spec pipe: now /dev/null; the spec never held expected outputs anyway.
  for code in ("import os\nos.lseek(0, 0, 0)\nprint(os.read(0, 1 << 20))", "print(open('/proc/self/fd/0').read())"):
    assert not run(code, [("", "secret-42")]).passed


def test_filesystem_is_private(host):
  secret, outside, site = host["secret"], host["outside"], host["site"]
  so = __import__("_ctypes").__file__
  attacks = {
      "read_secret": f"print(open({secret!r}).read())",
      "read_etc": "print(open('/etc/hostname').read(), open('/etc/passwd').read())",
      "write_outside": f"open({outside + '/x'!r}, 'w').write('x')\nprint('s3cret')",
      "pth_into_site": f"open({site + '/zz.pth'!r}, 'w').write('import os')\nprint('s3cret')",
      "pth_into_prefix": (f"import sys\nopen(sys.prefix + '/lib/python3.{sys.version_info[1]}/site-packages/zz.pth', 'w')"
                          f".write('x')\nprint('s3cret')"),
      "write_tmp": "open('/tmp/x', 'w').write('x')\nprint('s3cret')",
      "dir_fd_escape": (f"import os\nfd = os.open({outside!r}, os.O_RDONLY)\n"
                        f"os.close(os.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\nprint('s3cret')"),
      "symlink_out": f"import os\nos.symlink({secret!r}, 'l')\nprint(open('l').read())",
      "proc_cwd_dotdot": "open('/proc/self/cwd/../x', 'w')\nprint('s3cret')",
      "mkfifo_outside": f"import os\nos.mkfifo({outside + '/x'!r})\nprint('s3cret')",
      "mknod_outside": f"import os, stat\nos.mknod({outside + '/x'!r}, stat.S_IFREG | 0o644)\nprint('s3cret')",
      "ctypes_extension_loader": (f"import importlib.machinery as m\nl = m.ExtensionFileLoader('_ctypes', {so!r})\n"
                                  f"l.create_module(m.ModuleSpec('_ctypes', l, origin={so!r}))\n"
                                  f"print(open({secret!r}).read())"),
      # The race of issue 39: a SIGALRM handler swaps a symlink between a path check and the open.
      "symlink_swap_race": (
          f"import os, signal\nopen('ok', 'w').write('fine')\nos.symlink('ok', 'l')\nflip = [0]\n"
          f"def swap(*_):\n  flip[0] ^= 1\n  try:\n    os.symlink({secret!r} if flip[0] else 'ok', 't')\n"
          f"    os.replace('t', 'l')\n  except OSError:\n    pass\n"
          f"signal.signal(signal.SIGALRM, swap)\nsignal.setitimer(signal.ITIMER_REAL, 1e-4, 1e-4)\n"
          f"for _ in range(20000):\n  try:\n    t = open('l').read()\n  except OSError:\n    continue\n"
          f"  if t == 's3cret':\n    print(t)\n    break\nsignal.setitimer(signal.ITIMER_REAL, 0)\n"),
      # A nested user namespace with every capability in it, then mount and look for the host: nothing new.
      "nested_userns_mount": (f"import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                              f"assert libc.unshare(0x10000000 | 0x00020000) == 0, ctypes.get_errno()\n"
                              f"libc.mount(b'none', b'/work', b'tmpfs', 0, None)\nprint(open({secret!r}).read())"),
      "disk_quota": "for i in range(300):\n  open(f'f{i}', 'wb').write(b'x' * 60000)\nprint('s3cret')",
  }
  for name, code in attacks.items():
    r = run(code, [("", "s3cret")])
    assert not r.passed, (name, r)
    print(f"| {name} | scores 0: {r.stderr.strip()[-90:] or r.reason} |")
    assert_unharmed(host)
  # The control: without the sandbox (unsafe) the same programs do reach the host, so the attacks are real.
  unsafe = dataclasses.replace(FAST, unsafe=True)
  for name in ("read_secret", "symlink_swap_race", "pth_into_site"):
    assert run(attacks[name], [("", "s3cret")], unsafe).passed, name
  os.remove(os.path.join(site, "zz.pth"))


def test_processes_and_proc_are_private(host):
  pid = host["sentinel"].pid
  attacks = {
      "kill_sentinel": f"import os\nos.kill({pid}, 9)\nprint('ok')",
      "kill_everyone": "import os\nos.kill(-1, 9)\nprint('ok')",
      "pidfd_sentinel": f"import os, signal\nfd = os.pidfd_open({pid})\nsignal.pidfd_send_signal(fd, 9)\nprint('ok')",
      "scan_proc_environ": ("import os\nfor p in os.listdir('/proc'):\n  try:\n    e = open(f'/proc/{p}/environ').read()\n"
                            "  except OSError:\n    continue\n  if 'env-s3cret' in e:\n    print('ok')\n    break\n"),
      "see_host_processes": "import os\nif len([p for p in os.listdir('/proc') if p.isdigit()]) > 3:\n  print('ok')",
      "fork_bomb": "import os\nwhile True:\n  os.fork()\nprint('ok')",
      "subprocess_shell": "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\nprint('ok')",
      "threads": "import threading\nthreading.Thread(target=print).start()\nprint('ok')",
  }
  for name, code in attacks.items():
    r = run(code)
    assert not r.passed, (name, r)
    print(f"| {name} | scores 0: {r.stderr.strip()[-90:] or r.reason} |")
    assert_unharmed(host)


def test_group_mates_cannot_sabotage_each_other(host):
  """Two candidates scored at once (as the verifier pool does): one tries to kill every process it can find, by
  pid, by pidfd and by kill(-1); the other, slower and correct, still passes."""
  attacker = ("import os, signal, time\nfor _ in range(50):\n  for p in os.listdir('/proc'):\n"
              "    if p.isdigit() and int(p) != os.getpid():\n      for f in (lambda: os.kill(int(p), 9),\n"
              "                lambda: signal.pidfd_send_signal(os.pidfd_open(int(p)), 9)):\n"
              "        try:\n          f()\n        except OSError:\n          pass\n"
              "  try:\n    os.kill(-1, 9)\n  except OSError:\n    pass\n  time.sleep(0.01)\n")
  victim = "import time\ntime.sleep(0.5)\nprint(int(input()) + 1)"
  with concurrent.futures.ThreadPoolExecutor(2) as ex:
    v = ex.submit(run, victim, [("1", "2")])
    time.sleep(0.05)
    a = ex.submit(run, attacker, [("1", "2")])
    assert v.result().passed, v.result()
    assert not a.result().passed
  assert_unharmed(host)


def test_resources_are_bounded():
  t = time.monotonic()
  r = run("while True:\n  pass")
  assert not r.passed and r.reason in ("timeout", "killed by signal 24", "killed by signal 9"), r
  r = run("import time\ntime.sleep(100)")  # no CPU use: only the wall-time kill can stop it
  assert r.reason == "timeout", r
  assert not run("print('x' * (1 << 30))").passed  # 1 GB string: RLIMIT_AS
  assert not run("while True:\n  print('x' * 100000)").passed  # unbounded captured stdout
  assert not run("import os\nwhile True:\n  os.write(1, b'x' * 100000)").passed  # straight to fd 1: RLIMIT_FSIZE
  r = run("import sys\nwhile True:\n  sys.stderr.write('e' * 100000)")
  assert not r.passed and len(r.stderr) <= 2000
  assert not run("def f():\n  return 'x' * 200000", ["assert f() == 'x'"]).passed  # result over output_bytes
  assert time.monotonic() - t < 8 * FAST.wall_s


def test_no_network():
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  try:
    probe = (f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=1)\n"
             f"print('ok')")
    r = run(probe)
    assert not r.passed and "Connection refused" in r.stderr, r  # its own loopback: nothing listens there
  finally:
    server.close()


def test_no_bwrap_refuses_unless_unsafe(monkeypatch):
  monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
  with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap"):
    run("print('ok')")
  assert run("print('ok')", limits=dataclasses.replace(FAST, unsafe=True)).passed
  # In the verifier pool's processes too: score() raises it (the worker then fails the item with this reason).
  monkeypatch.setenv("PATH", "/nonexistent")  # what the spawned pool processes inherit: no bwrap for them
  with data.VerifierPool(max_workers=1) as pool, pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap"):
    pool.score([Problem("c", "?", "", "code", (("", "ok"),))], ["print('ok')"])

"""Atomic file writes (temp file + rename) for every writer (data, train, param_server): a reader, or a restart
after a crash, sees the old file or the whole new one, never a torn one."""
import contextlib
import os


def fsync_dir(path):
  fd = os.open(path or ".", os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_atomic(path, data, fsync=False, mode=0o666, tmp=None):
  """Writes data (str as UTF-8, bytes, or an iterable of either) to tmp (default path.tmp), renamed onto path; a
  failure before the rename removes tmp (not to hold disk space) and raises. fsync=True: fsync the file before the
  rename, its directory after (else a power loss can undo it). mode: before the umask (0o666 is open()'s)."""
  tmp = tmp or f"{path}.tmp"
  chunks = [data] if isinstance(data, (str, bytes, bytearray, memoryview)) else data
  try:
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as f:
      for c in chunks:
        f.write(c.encode() if isinstance(c, str) else c)
      if fsync:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
  if fsync:
    fsync_dir(os.path.dirname(path))

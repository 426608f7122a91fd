"""Atomic file writes (temp file + rename), written once for every writer of the project (data, train,
param_server): a reader, or a restart after a crash, sees the old file or the whole new one, never a torn one.

write_atomic(path, data, fsync=False, mode=0o666): data is str (UTF-8), bytes, or an iterable of either (e.g.
chunks of a large buffer). fsync=True makes the write durable before it returns: the temp file is fsync'ed
before the rename and the directory after it (without the latter a power loss can undo the rename).
"""
import os


def fsync_dir(path):
  fd = os.open(path or ".", os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_atomic(path, data, fsync=False, mode=0o666, tmp=None):
  """Writes data to `tmp` (default path + ".tmp"), then renames it onto path; on any failure before the rename
  the temp file is removed (it must not keep holding disk space) and the error raised, path left as it was.
  mode: the new file's permissions before the umask (0o666 = open()'s; a secret wants 0o600)."""
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
    try:
      os.remove(tmp)
    except OSError:
      pass
    raise
  if fsync:
    fsync_dir(os.path.dirname(path))

"""Files and directories only their owner may read: keys, tokens, the runtime directory's sockets.

Each secret file is created with mode 0600 (never written under the umask and tightened after: a
reader could open it in between and keep its descriptor), and each directory that holds secrets or
sockets is 0700 and must belong to this user: a directory another user made first (a world-writable
``/tmp`` lets anyone create ``/tmp/vllm-disagg-<uid>``), or a symbolic link, is refused rather than
trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from pathlib import Path

from vllm_disagg.errors import ConfigError


def private_dir(path: Path) -> Path:
    """``path`` as a directory of this user with mode 0700, created (with its parents) if missing.

    ``ConfigError`` when it is a symbolic link, not a directory, or another user's.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"cannot create the private directory {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} must be a directory, not a symbolic link or a file: refusing to use it")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"{path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): refusing to use it "
            "(another user may read or replace what is put there)"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours: made looser by an earlier run or by hand
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``, readable by this user only from the moment it exists.

    A file already there is replaced (its old mode could be looser); a symbolic link there is not
    followed.
    """
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def runtime_dir(base: str | None = None) -> Path:
    """This user's runtime directory for sockets: ``$XDG_RUNTIME_DIR/vllm-disagg`` where the system
    gives one (a tmpfs only this user can enter), else ``$TMPDIR/vllm-disagg-<uid>``; not created."""
    if base:
        return Path(base) / f"vllm-disagg-{os.getuid()}"
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "vllm-disagg"
    return Path(tempfile.gettempdir()) / f"vllm-disagg-{os.getuid()}"


def mask(secret: str) -> str:
    """What a log line may show of a secret: a digest's first characters, enough to match the lines
    of one grant, nothing of the secret itself."""
    return "#" + hashlib.sha256(secret.encode()).hexdigest()[:8]

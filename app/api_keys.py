"""Where an API key comes from: `--api-key`, `--api-key-file` or `NPUCHAT_API_KEY`.

A key given as `--api-key KEY` sits in the process's command line, which every user of the
machine can read (`ps`, /proc/PID/cmdline): the one secret guarding a server from other local
users would be handed to them. A file (only its owner may read it) or the environment (only
the owner's processes) keeps it private. `npuchat serve` accepts several keys in the file, one
a line (llama-server's `--api-key-file`), so each client can have its own and one can be
revoked alone; a client (`npuchat --server`) sends the file's first.

The client never falls back to `OPENAI_API_KEY`: that key would go to whatever server `--server`
names.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

from npuchat.engine.errors import NpuchatError

ENV_VAR = "NPUCHAT_API_KEY"
MAX_FILE_BYTES = 64 * 1024  # far more than any list of keys; a larger file is not one
MAX_KEY_CHARS = 1024


def _checked(key: str, where: str) -> str:
    """A key a client can send in an `Authorization` header: printable ASCII, no spaces."""
    if not key:
        raise NpuchatError(f"{where}: the API key is empty; give a key of printable characters")
    if len(key) > MAX_KEY_CHARS:
        raise NpuchatError(f"{where}: an API key of {len(key)} characters; give at most 1,024")
    if not all("!" <= c <= "~" for c in key):
        raise NpuchatError(
            f"{where}: an API key may hold only printable ASCII without spaces (it travels in "
            "an HTTP header)"
        )
    return key


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys in `path`, one a line (blank lines and `#` comments skipped)."""
    file = Path(path).expanduser()
    try:  # O_NONBLOCK: a FIFO given as the file must not hang the start waiting for a writer
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise NpuchatError(f"--api-key-file {path}: not a file; give a file of keys")
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise NpuchatError(f"--api-key-file {path}: {why}; give a readable file") from None
    if len(raw) > MAX_FILE_BYTES:
        raise NpuchatError(f"--api-key-file {path}: over 64 KiB, not a file of keys")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise NpuchatError(f"--api-key-file {path}: not UTF-8 text; give a file of keys") from None
    where = f"--api-key-file {path}"
    keys = tuple(
        _checked(line.strip(), where)
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    if not keys:
        raise NpuchatError(f"{where}: holds no key; write one key a line")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(
            f"npuchat: warning: {path} can be read by other users; `chmod 600 {path}`",
            file=sys.stderr,
        )
    return keys


def api_keys(
    given: str | None, key_file: str | None, environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The keys in force: the flag's, else the file's, else `NPUCHAT_API_KEY`'s; none: ()."""
    if given is not None and key_file is not None:
        raise NpuchatError("give --api-key or --api-key-file, not both")
    if given is not None:
        return (_checked(given, "--api-key"),)
    if key_file is not None:
        return read_key_file(key_file)
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "")
    return (_checked(value.strip(), ENV_VAR),) if value.strip() else ()

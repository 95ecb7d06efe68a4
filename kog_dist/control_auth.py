"""Who may reach the control plane: loopback by default; other addresses only with --allow-remote
and CURVE keys (zmq.auth key files). Who may stop it: a client that shows the server's secret, a
random token the coordinator writes 0600 into the runtime directory ($XDG_RUNTIME_DIR/kog_dist, else
~/.cache/kog_dist/run) under a name made from its endpoint, as Jupyter does with its connection files;
other local users cannot read it. CURVE clients are authenticated already and need no secret."""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass

from . import protocol as P


class ControlError(Exception):
    """The control plane cannot start (a refused bind, missing CURVE keys); one-line message."""


@dataclass
class CurveKeys:
    """CURVE material: the server's secret key file (zmq.auth .key_secret) and a directory of the
    authorised clients' public key files (.key)."""
    server_secret_file: str
    clients_dir: str


def check_endpoint(endpoint: str, allow_remote: bool = False, curve_keys: CurveKeys | None = None) -> None:
    """Raise ControlError unless binding `endpoint` is allowed (call it before starting ranks)."""
    try:
        local = P.is_loopback(endpoint)
    except ValueError as e:
        raise ControlError(str(e)) from None
    if not local and not allow_remote:
        raise ControlError(f"refusing to bind {endpoint}: not a loopback address; pass --allow-remote "
                           "with CURVE keys to serve other machines")
    if not local and curve_keys is None:
        raise ControlError(f"refusing to bind {endpoint} with --allow-remote but no CURVE keys; "
                           "give the server secret key file and the authorised clients' key directory")
    if curve_keys is not None:
        if not curve_keys.server_secret_file or not curve_keys.clients_dir:
            raise ControlError("CURVE needs both the server secret key file and the clients key directory")
        if not os.path.isfile(curve_keys.server_secret_file):
            raise ControlError(f"CURVE server secret key file not found: {curve_keys.server_secret_file}")
        if not os.path.isdir(curve_keys.clients_dir):
            raise ControlError(f"CURVE clients key directory not found: {curve_keys.clients_dir}")


# ------------------------------------------------------------------------------------ the shutdown secret
def runtime_dir() -> str:
    """Where servers leave their secrets: $XDG_RUNTIME_DIR/kog_dist, else ~/.cache/kog_dist/run."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return os.path.join(base, "kog_dist")
    return os.path.join(os.path.expanduser("~"), ".cache", "kog_dist", "run")


def secret_path(endpoint: str) -> str:
    """The secret file of a server at `endpoint`. A tcp endpoint is named by its port only, so that a
    client of tcp://localhost:5555 finds the file of a server bound at tcp://127.0.0.1:5555."""
    if endpoint.startswith("tcp://"):
        name = "tcp-" + endpoint.rsplit(":", 1)[-1]
    else:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", endpoint)
        if len(name) > 80:
            name = name[:40] + "-" + hashlib.sha256(endpoint.encode()).hexdigest()[:16]
    return os.path.join(runtime_dir(), f"{name}.secret")


def write_secret(endpoint: str) -> tuple[str, str]:
    """Make a fresh secret for the server bound at `endpoint`; return (path, secret). The directory is
    made 0700 and the file 0600 (written under a temporary name, then renamed over any stale one)."""
    path = secret_path(endpoint)
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            os.chmod(folder, 0o700)         # raises unless the folder is ours
        token = secrets.token_hex(32)
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise ControlError(f"cannot write the shutdown secret {path}: {e.strerror or e}") from None
    return path, token


def read_secret(endpoint: str) -> str | None:
    """The secret a server at `endpoint` left for this user, or None."""
    try:
        with open(secret_path(endpoint)) as f:
            return f.read(1024).strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def remove_secret(path: str, token: str) -> None:
    """Remove the file if it still holds `token` (a later server on the same port may own it now)."""
    try:
        with open(path) as f:
            if f.read(1024).strip() != token:
                return
        os.unlink(path)
    except OSError:
        pass


def secret_matches(given, token) -> bool:
    return isinstance(given, str) and token is not None and hmac.compare_digest(given.encode(), token.encode())

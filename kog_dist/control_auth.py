"""Who may reach the control plane: loopback by default; other addresses only with --allow-remote
and CURVE keys (zmq.auth key files)."""
from __future__ import annotations

import os
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

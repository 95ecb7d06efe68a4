"""The `kog client` command line: generate, health, stats, cancel, shutdown, run SCRIPT.jsonl
(docs/protocol.md). The library it drives is kog_dist/client.py."""
from __future__ import annotations

import argparse
import json
import sys

import zmq

from kog_dist import protocol as P
from .cli import UsageError, _Parser
from .cli import parse_ids as _ids
from kog_dist.client import DEFAULT_ENDPOINT, Client, ClientTimeout, GenerateResult, ServerError


def _parser() -> argparse.ArgumentParser:
    def common(p, top):
        d = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
        p.add_argument("--connect", default=d(DEFAULT_ENDPOINT), help=f"server endpoint (default {DEFAULT_ENDPOINT})")
        p.add_argument("--timeout", type=float, default=d(None),
                       help="seconds to wait for each server message (default 10 for health/stats/cancel/"
                            "shutdown, 60 otherwise)")
        p.add_argument("--server-key", default=d(None), help="CURVE: the server's public key file")
        p.add_argument("--client-key", default=d(None), help="CURVE: this client's secret key file")
        p.add_argument("--json", action="store_true", default=d(False), help="print JSON")
    p = _Parser(prog="kog client", description="Talk to a running kog_dist server (docs/protocol.md).")
    common(p, True)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="one request")
    common(g, False)
    w = g.add_mutually_exclusive_group(required=True)
    w.add_argument("--prompt", help="prompt text")
    w.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    g.add_argument("--max-new-tokens", "-n", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-ids", default="", help="comma-separated ids that end the generation")
    g.add_argument("--no-bos", action="store_true", help="do not put BOS before a text prompt")
    g.add_argument("--stream", action="store_true", help="print text as it is produced")
    for name in ("health", "stats", "shutdown"):
        common(sub.add_parser(name, help=f"the server's {name}" if name != "shutdown" else "stop the server"), False)
    c = sub.add_parser("cancel", help="cancel the running decode (or --rid N)")
    common(c, False)
    c.add_argument("--rid", type=int, default=None)
    r = sub.add_parser("run", help="replay a scripted session: one JSON object per line")
    common(r, False)
    r.add_argument("script")
    return p


SCRIPT_FIELDS = {"append": {"op", "prompt", "prompt_ids", "add_bos"},
                 "generate": {"op", "prompt", "prompt_ids", "add_bos", "max_new_tokens", "temperature", "top_k",
                              "top_p", "seed", "stop", "stop_ids"}}


def load_script(path: str) -> list:
    """Steps of a SCRIPT.jsonl, checked before anything is sent."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    steps = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not JSON: {e.msg}") from None
        if not isinstance(step, dict) or step.get("op") not in SCRIPT_FIELDS:
            raise UsageError(f'{path}:{n}: each line must be an object with "op": "append" or "generate"')
        extra = set(step) - SCRIPT_FIELDS[step["op"]]
        if extra:
            raise UsageError(f"{path}:{n}: unknown field(s) for {step['op']}: {', '.join(sorted(extra))}")
        if step["op"] == "append" and ("prompt" in step) == ("prompt_ids" in step):
            raise UsageError(f"{path}:{n}: append needs exactly one of prompt, prompt_ids")
        try:                                  # the same schema the server applies
            P.parse_request({"v": P.VERSION, "session": "x", **step})
        except P.ProtocolError as e:
            raise UsageError(f"{path}:{n}: {e.message}") from None
        steps.append(step)
    if not steps:
        raise UsageError(f"{path}: no steps")
    return steps


def _step_row(i, step, res: GenerateResult) -> dict:
    row = {"step": i, "op": step["op"], "stop_reason": res.stop_reason, "stats": res.stats}
    if step["op"] == "generate":
        row.update(token_ids=res.token_ids, text=res.text)
    return row


def _table(rows) -> str:
    head = f"{'step':>4} {'op':<8} {'prefill':>7} {'reused':>6} {'new':>5} {'prefill_ms':>10} {'ttft_ms':>8} " \
           f"{'tok/s':>8} {'total_ms':>9}  stop"
    out = [head]
    for r in rows:
        s = r["stats"]
        out.append(f"{r['step']:>4} {r['op']:<8} {s.get('prefill_tokens', 0):>7} {s.get('reused_tokens', 0):>6} "
                   f"{s.get('new_tokens', 0):>5} {s.get('prefill_ms', 0):>10.2f} {s.get('ttft_ms', 0):>8.2f} "
                   f"{s.get('decode_tokens_per_s', 0):>8.1f} {s.get('total_ms', 0):>9.2f}  {r['stop_reason']}")
    return "\n".join(out)


def _print_map(d: dict, prefix="") -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            _print_map(v, f"{prefix}{k}.")
        else:
            print(f"{prefix}{k}: {round(v, 3) if isinstance(v, float) else v}")


def _run(a) -> int:
    script = load_script(a.script) if a.cmd == "run" else None
    quick = a.cmd in ("health", "stats", "shutdown", "cancel")
    timeout = a.timeout if a.timeout is not None else (10.0 if quick else 60.0)
    with Client(a.connect, timeout=timeout, server_key=a.server_key, client_key=a.client_key) as c:
        if a.cmd in ("health", "stats", "shutdown", "cancel"):
            out = getattr(c, a.cmd)() if a.cmd != "cancel" else {"cancelled": c.cancel(rid=a.rid)}
            print(json.dumps(out)) if a.json else _print_map(out)
            return 0
        if a.cmd == "generate":
            kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                      seed=a.seed, stop=a.stop, stop_ids=_ids(a.stop_ids, "--stop-ids") or None,
                      add_bos=False if a.no_bos else None)
            ids = _ids(a.prompt_ids, "--prompt-ids") if a.prompt_ids is not None else None
            st = c.stream(a.prompt, ids, _stream=a.stream and not a.json, **kw)
            for chunk in st:
                sys.stdout.write(chunk["text"])
                sys.stdout.flush()
            res = st.result
            if a.json:
                print(json.dumps(res.as_dict()))
                return 0
            print("" if a.stream else res.text)
            s = res.stats
            print(f"[rid {res.rid}] prefill {s.get('prefill_tokens')} tokens in {s.get('prefill_ms', 0):.1f} ms, "
                  f"ttft {s.get('ttft_ms', 0):.1f} ms, {s.get('new_tokens')} new tokens, "
                  f"{s.get('decode_tokens_per_s', 0):.1f} tok/s (stop: {res.stop_reason})", file=sys.stderr)
            return 0
        rows = []
        with c.session() as sess:
            for i, step in enumerate(script):
                fields = {k: v for k, v in step.items() if k != "op"}
                if step["op"] == "append":
                    res = sess.append(fields.get("prompt"), fields.get("prompt_ids"), fields.get("add_bos"))
                else:
                    res = sess.generate(fields.pop("prompt", None), fields.pop("prompt_ids", None), **fields)
                rows.append(_step_row(i, step, res))
        print(json.dumps(rows) if a.json else _table(rows))
        return 0


def main(argv=None) -> int:
    """`kog client ...`; returns the exit code (0 ok, 1 server or connection error, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = _parser().parse_args(argv)
        return _run(a)
    except SystemExit as e:                # --help
        return int(e.code or 0)
    except UsageError as e:
        print(f"kog client: error: {e}", file=sys.stderr)
        return 2
    except ServerError as e:
        print(f"kog client: error: server: {e.code}: {e.message}", file=sys.stderr)
        return 1
    except (ClientTimeout, zmq.ZMQError, OSError) as e:
        print(f"kog client: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"kog client: error: {str(e).splitlines()[0] if str(e) else 'bad value'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:                 # never a traceback
        print(f"kog client: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

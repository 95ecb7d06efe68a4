"""`kog chat`: an interactive terminal chat with streamed answers.

    kog chat [--model M] [--np N] [--system TEXT] [-n N] [--temperature T] ...   # starts its own ranks
    kog chat --connect tcp://HOST:PORT ...                                        # a running kog-worker job

The conversation lives in one control-plane session: every turn sends the whole chat as `messages`
(the coordinator renders the model's chat template) and the session's KV slot keeps the longest
common prefix, so a turn prefills only what is new (the last answer's end and the new question).
Commands: /reset (a new conversation), /stats (TTFT, tokens/s, reused and prefilled tokens),
/help, /quit. Ctrl-C stops the answer being written; Ctrl-D (end of input) leaves.
"""
from __future__ import annotations

import argparse
import secrets
import signal
import sys
import time

from kog_dist.client import Client, ClientTimeout, ServerError, ServerGone, Stream
from launch.cli import free_port

from .serve import UsageError, _Parser, rank_command, start_ranks, stop_ranks

HELP = "/reset starts over, /stats shows timings, /quit or Ctrl-D leaves; Ctrl-C stops an answer"


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kog chat", description="Chat with a model in the terminal (streamed answers).")
    p.add_argument("--model", help="model path or built-in name (as kog-worker --model)")
    p.add_argument("--np", type=int, default=1, dest="nranks", help="ranks (more than 1: under mpiexec)")
    p.add_argument("--connect", metavar="ENDPOINT", help="a running kog-worker job's --control endpoint")
    p.add_argument("--system", help="a system message at the start of the conversation")
    p.add_argument("--max-new-tokens", "-n", type=int, default=512, help="at most this many tokens per answer")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="default: a new one per turn")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--max-seq", type=int, default=None)
    p.add_argument("--dtype", default=None, help="storage of the layer matrices (as kog generate --dtype)")
    p.add_argument("--speculative", type=int, default=None, metavar="K",
                   help="prompt-lookup speculative decoding, up to K (0..8; 0 = off) draft tokens (default: the "
                        "backend's, off today on cpu and cuda)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server")
    p.add_argument("--server-key", help="with --connect: the server's CURVE public key file")
    p.add_argument("--client-key", help="with --connect: this client's CURVE secret key file")
    return p


def _wait_ready(client: Client, proc, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the ranks exited ({proc.returncode}) before the model was loaded")
        try:
            h = client.health()
            if h.get("status") == "ok":
                return h
        except (ClientTimeout, ServerGone):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from {client.endpoint} within {timeout:g} s")
        time.sleep(0.1)


class Chat:
    def __init__(self, client: Client, a, out=sys.stdout, err=sys.stderr):
        self.client, self.a, self.out, self.err = client, a, out, err
        self.session = None
        self.messages: list[dict] = []
        self.turns: list[dict] = []

    def reset(self):
        if self.session is not None:
            try:
                self.session.close()
            except (ServerError, ClientTimeout, ServerGone):
                pass
        self.session = self.client.session()
        self.messages = [{"role": "system", "content": self.a.system}] if self.a.system else []
        self.turns = []

    def _request(self, messages) -> dict:
        a = self.a
        msg = {"op": "generate", "session": self.session.id, "messages": messages, "stream": True,
               "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_p": a.top_p,
               "top_k": a.top_k}
        msg["seed"] = a.seed if a.seed is not None else secrets.randbits(63)
        return msg

    def turn(self, text: str):
        messages = self.messages + [{"role": "user", "content": text}]
        t0 = time.perf_counter()
        flag = {"stop": False, "sent": False, "st": None}

        def cancel():
            st = flag["st"]
            if flag["stop"] and not flag["sent"] and st is not None and st.rid is not None:
                flag["sent"] = True
                st.cancel()

        def on_sigint(signum, frame):
            # Ctrl-C stops this answer only: cancel at once (Client.cancel uses a socket of its own)
            # and keep reading, so the partial answer and its result still arrive; twice: leave
            if flag["stop"]:
                raise KeyboardInterrupt
            flag["stop"] = True
            cancel()
        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            for attempt in (0, 1):
                flag["st"] = st = Stream(self.client, self._request(messages))
                try:
                    for ch in st:
                        cancel()                 # a Ctrl-C that came before the server's `accepted`
                        self.out.write(ch["text"])
                        self.out.flush()
                    break
                except ServerError as e:
                    if e.code != "no_session" or attempt:
                        raise
                    self.session = self.client.session()    # expired while idle: the history prefills again
        finally:
            signal.signal(signal.SIGINT, previous)
        self.out.write(" [stopped]\n" if flag["stop"] else "\n")
        self.out.flush()
        r = st.result
        if r is None:
            return
        self.messages = messages + [{"role": "assistant", "content": r.text}]
        self.turns.append(dict(r.stats, stop_reason=r.stop_reason, wall_ms=(time.perf_counter() - t0) * 1000))

    def stats(self) -> str:
        if not self.turns:
            return "stats: no turns yet"
        s = self.turns[-1]
        n = sum(t.get("new_tokens", 0) for t in self.turns)
        return (f"stats: turn {len(self.turns)}: ttft_ms {s.get('ttft_ms', 0):.1f}, tokens_per_s "
                f"{s.get('decode_tokens_per_s', 0):.1f}, new_tokens {s.get('new_tokens', 0)}, reused_tokens "
                f"{s.get('reused_tokens', 0)}, prefill_tokens {s.get('prefill_tokens', 0)}, context "
                f"{s.get('context', 0)}, stop {s.get('stop_reason')}; conversation: {n} tokens generated")

    def loop(self, stdin=sys.stdin) -> int:
        tty = stdin.isatty()
        if tty:
            try:
                # line editing and history for input(), on a terminal only (optional: some Pythons lack it)
                import readline  # noqa: F401
            except ImportError:
                pass
        while True:
            try:
                line = input("you> ") if tty and stdin is sys.stdin else stdin.readline()
                if not tty and line == "":
                    raise EOFError
            except EOFError:
                if tty:
                    self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n")
                continue
            line = line.rstrip("\n")
            if not line.strip():
                continue
            cmd = line.strip()
            if cmd in ("/quit", "/exit"):
                return 0
            if cmd == "/reset":
                self.reset()
                self.out.write("(a new conversation)\n")
                continue
            if cmd == "/stats":
                self.out.write(self.stats() + "\n")
                continue
            if cmd in ("/help", "/?"):
                self.out.write(HELP + "\n")
                continue
            if cmd.startswith("/") and " " not in cmd:
                self.out.write(f"unknown command {cmd}; {HELP}\n")
                continue
            try:
                self.turn(line)
            except ServerError as e:         # refused (busy, too long...): say so, keep the conversation
                self.out.write("\n")
                self.err.write(f"kog chat: {e.code}: {e.message}\n")
                self.err.flush()


def main(argv=None) -> int:
    try:
        a = parser().parse_args(argv)
        if a.nranks < 1 or a.max_new_tokens < 1:
            raise UsageError("--np and --max-new-tokens must be >= 1")
        if a.connect and (a.model or a.nranks != 1):
            raise UsageError("--connect talks to a running job: --model and --np belong to that job")
        control = a.connect or f"tcp://127.0.0.1:{free_port()}"
        kind = None
        if not a.connect:
            sa = argparse.Namespace(model=a.model, nranks=a.nranks, backend=a.backend, max_seq=a.max_seq,
                                    slots=2, queue_limit=4, bind=None, dtype=a.dtype, speculative=a.speculative)
            cmd, kind = rank_command(sa, control)
        client = Client(control, timeout=a.timeout, server_key=a.server_key, client_key=a.client_key)
    except (UsageError, ValueError) as e:
        print(f"kog chat: error: {e}", file=sys.stderr)
        return 2
    proc = None if a.connect else start_ranks(cmd)
    try:
        h = _wait_ready(client, proc, a.timeout if a.connect else max(a.timeout, 300.0))
        chat = Chat(client, a)
        chat.reset()
        print(f"kog chat: model {h.get('model') or a.model or '?'} (context {h.get('max_seq')} tokens"
              f"{'' if h.get('chat_template') else ', no chat template: ChatML as plain text'}); {HELP}",
              file=sys.stderr, flush=True)
        return chat.loop()
    except (RuntimeError, ServerError, ServerGone, ClientTimeout) as e:
        print(f"kog chat: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()
        if proc is not None:
            stop_ranks(proc, kind)


if __name__ == "__main__":
    sys.exit(main())

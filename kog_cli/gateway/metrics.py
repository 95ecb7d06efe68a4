"""The gateway's counters and histograms, written in the Prometheus text format (version 0.0.4) by hand:
a few dozen lines do not justify a dependency."""
from __future__ import annotations

import bisect
import collections

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float, times: int = 1):
        self.counts[bisect.bisect_left(self.buckets, v)] += times
        self.sum += v * times
        self.n += times

    def lines(self, name):
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    def __init__(self):
        self.requests = collections.Counter()      # (endpoint, status) -> n
        self.tokens = 0
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self.spec_drafted = self.spec_accepted = self.spec_steps = 0
        self.in_flight = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.per_token = Histogram(TOKEN_BUCKETS)
        self.last_tokens_per_s = 0.0

    def request(self, endpoint: str, status: int):
        self.requests[(endpoint, int(status))] += 1

    def finished(self, stats: dict, ttft_s: float | None):
        n = int(stats.get("new_tokens", 0))
        self.tokens += n
        self.prompt_tokens += int(stats.get("context", n)) - n
        self.reused_tokens += int(stats.get("reused_tokens", 0))
        self.spec_drafted += int(stats.get("spec_drafted", 0))
        self.spec_accepted += int(stats.get("spec_accepted", 0))
        self.spec_steps += int(stats.get("spec_steps", 0))
        if ttft_s is not None and n:
            self.ttft.observe(ttft_s)
        decode_ms = float(stats.get("decode_ms", 0.0))
        if n > 1 and decode_ms > 0:
            self.per_token.observe(decode_ms / 1000 / (n - 1), n - 1)
            self.last_tokens_per_s = (n - 1) * 1000 / decode_ms

    def render(self, health: dict | None) -> str:
        h = health or {}
        out = ["# HELP kog_requests_total HTTP requests answered, by endpoint and status.",
               "# TYPE kog_requests_total counter"]
        for (ep, st), n in sorted(self.requests.items()):
            out.append(f'kog_requests_total{{endpoint="{ep}",status="{st}"}} {n}')
        out += ["# HELP kog_generated_tokens_total Tokens generated.", "# TYPE kog_generated_tokens_total counter",
                f"kog_generated_tokens_total {self.tokens}",
                "# HELP kog_prompt_tokens_total Prompt tokens of finished requests.",
                "# TYPE kog_prompt_tokens_total counter", f"kog_prompt_tokens_total {self.prompt_tokens}",
                "# HELP kog_reused_tokens_total Prompt tokens taken from a KV cache instead of prefilled.",
                "# TYPE kog_reused_tokens_total counter", f"kog_reused_tokens_total {self.reused_tokens}",
                "# HELP kog_speculative_draft_tokens_total Draft tokens proposed by prompt lookup.",
                "# TYPE kog_speculative_draft_tokens_total counter",
                f"kog_speculative_draft_tokens_total {self.spec_drafted}",
                "# HELP kog_speculative_accepted_tokens_total Draft tokens accepted (verified in one pass).",
                "# TYPE kog_speculative_accepted_tokens_total counter",
                f"kog_speculative_accepted_tokens_total {self.spec_accepted}",
                "# HELP kog_speculative_passes_total Verify passes that checked a draft.",
                "# TYPE kog_speculative_passes_total counter", f"kog_speculative_passes_total {self.spec_steps}",
                "# HELP kog_speculative_tokens_per_pass Tokens a verify pass gave (accepted drafts + 1), all requests.",
                "# TYPE kog_speculative_tokens_per_pass gauge",
                f"kog_speculative_tokens_per_pass {tokens_per_pass(self.spec_steps, self.spec_accepted):.3f}",
                "# HELP kog_time_to_first_token_seconds From the HTTP request to its first token.",
                "# TYPE kog_time_to_first_token_seconds histogram",
                *self.ttft.lines("kog_time_to_first_token_seconds"),
                "# HELP kog_time_per_output_token_seconds Decode time per token after the first.",
                "# TYPE kog_time_per_output_token_seconds histogram",
                *self.per_token.lines("kog_time_per_output_token_seconds"),
                "# HELP kog_requests_in_flight Requests the gateway is serving now.",
                "# TYPE kog_requests_in_flight gauge", f"kog_requests_in_flight {self.in_flight}",
                "# HELP kog_queue_depth Requests waiting behind the running decode (coordinator).",
                "# TYPE kog_queue_depth gauge", f"kog_queue_depth {int(h.get('queue', 0) or 0)}",
                "# HELP kog_last_decode_tokens_per_second Decode speed of the last finished request.",
                "# TYPE kog_last_decode_tokens_per_second gauge",
                f"kog_last_decode_tokens_per_second {self.last_tokens_per_s:.3f}",
                "# HELP kog_up 1 when the coordinator answers and the model is loaded.",
                "# TYPE kog_up gauge", f"kog_up {int(h.get('status') == 'ok')}"]
        return "\n".join(out) + "\n"


def tokens_per_pass(steps: int, accepted: int) -> float:
    """Tokens a verify pass gives: its accepted drafts and the token it draws itself (0 with no pass)."""
    return (steps + accepted) / steps if steps else 0.0

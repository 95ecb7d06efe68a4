"""`kog topo` / `kog-topo`: report the machine, its GPU links and partitions, and the rank plan.

  kog topo [--ranks N] [--json] [--sysfs-root DIR] [--amd-smi-json FILE] [--no-nvml]

Exit status: 0 on success, 2 on bad input (missing or malformed tree or file, impossible plan),
with one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys

from .model import TopologyError
from .plan import plan
from .probe import probe
from .report import render, to_json


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as the rest of the tool
        raise TopologyError(message)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kog topo", description="Probe the machine and plan rank placement.")
    ap.add_argument("--ranks", type=int, default=None,
                    help="ranks to plan (default: one per GPU, or per NUMA node without GPUs)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the report")
    ap.add_argument("--sysfs-root", metavar="DIR", default=None,
                    help="read a recorded sysfs tree instead of /sys (NVML and amd-smi are off)")
    ap.add_argument("--amd-smi-json", metavar="FILE", default=None,
                    help="read recorded amd-smi JSON instead of running amd-smi")
    ap.add_argument("--no-nvml", action="store_true", help="do not query NVML")
    return ap


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
        m = probe(sysfs_root=args.sysfs_root, amd_smi_json=args.amd_smi_json,
                  use_nvml=False if args.no_nvml else None)
        p = plan(m, args.ranks)
    except TopologyError as e:
        print(f"kog topo: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.json:
            json.dump(to_json(m, p), sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(render(m, p))
        sys.stdout.flush()
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

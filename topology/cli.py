"""`kog topo` / `kog-topo`: report the machine, its GPU links and partitions, and the rank plan.

  kog topo [--ranks N] [--json] [--sysfs-root DIR] [--amd-smi-json FILE] [--no-nvml]
  kog topo --record DIR [--sysfs-root SRC] [--no-nvml]   record this machine (topology/record.py)

Exit status: 0 on success, 2 on bad input (missing or malformed tree or file, impossible plan,
a --record DIR that exists and is not empty or cannot be written), with one line on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys

from .model import TopologyError
from .plan import plan
from .probe import probe
from .record import record
from .report import render, to_json


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as the rest of the tool
        raise TopologyError(message)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kog topo", description="Probe the machine and plan rank placement.")
    ap.add_argument("--ranks", type=int, default=None,
                    help="ranks to plan (default: one per GPU, or per NUMA node without GPUs)")
    ap.add_argument("--cpu", action="store_true",
                    help="plan CPU cores only: the placement of CPU-backend ranks (on a GPU machine too)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the report")
    ap.add_argument("--sysfs-root", metavar="DIR", default=None,
                    help="read a recorded sysfs tree instead of /sys (NVML and amd-smi are off)")
    ap.add_argument("--amd-smi-json", metavar="FILE", default=None,
                    help="read recorded amd-smi JSON instead of running amd-smi")
    ap.add_argument("--no-nvml", action="store_true", help="do not query NVML")
    ap.add_argument("--record", metavar="DIR", default=None,
                    help="write this machine (or the --sysfs-root tree) as a recorded tree in the "
                         "new or empty DIR, for --sysfs-root DIR")
    return ap


def _record(args) -> int:
    if args.ranks is not None or args.json or args.amd_smi_json or args.cpu:
        raise TopologyError("--record takes only --sysfs-root and --no-nvml")
    r = record(args.record, args.sysfs_root, use_nvml=False if args.no_nvml else None)
    print(f"kog topo: recorded {r['dest']}: {r['files']} files, {r['pci_devices']} PCI devices, "
          f"{r['gpus']} GPUs, {r['links']} links in kog-links.json; read it with "
          f"kog topo --sysfs-root {r['dest']}")
    for d in r["differences"]:
        print(f"kog topo: warning: the recording differs from the live probe in {d}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.record is not None:
            return _record(args)
        m = probe(sysfs_root=args.sysfs_root, amd_smi_json=args.amd_smi_json,
                  use_nvml=False if args.no_nvml else None)
        p = plan(m, args.ranks, use_gpus=not args.cpu)
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

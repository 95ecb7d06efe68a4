"""Bad input to `kog topo`: exit status 2 and exactly one line on stderr, never a traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures", "topology")


def kog_topo(*args):
    return subprocess.run([sys.executable, "-m", "topology.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def assert_one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("kog topo: error: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def tree(tmp_path, name="cpu_2core"):
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIX, name), dst, symlinks=True)
    return dst


def test_missing_tree(tmp_path):
    assert_one_line_error(kog_topo("--sysfs-root", str(tmp_path / "nope")), "no such directory")


def test_empty_tree(tmp_path):
    assert_one_line_error(kog_topo("--sysfs-root", str(tmp_path)), "bus/pci/devices")


def test_tree_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    assert_one_line_error(kog_topo("--sysfs-root", str(f)))


@pytest.mark.parametrize("rel,text,word", [
    ("devices/system/node/node0/cpulist", "zero-one", "cpulist"),
    ("bus/pci/devices/0000:00:05.0/numa_node", "minus one", "numa_node"),
    ("bus/pci/devices/0000:00:05.0/vendor", "nvidia", "vendor"),
    ("bus/pci/devices/0000:00:05.0/local_cpulist", "0-", "local_cpulist"),
])
def test_malformed_files(tmp_path, rel, text, word):
    t = tree(tmp_path, "vm_1gpu")
    (t / rel).write_text(text + "\n")
    assert_one_line_error(kog_topo("--sysfs-root", str(t)), word)


def test_node_without_cpulist_and_device_without_class(tmp_path):
    t = tree(tmp_path, "vm_1gpu")
    os.remove(t / "bus/pci/devices/0000:00:05.0/class")
    assert_one_line_error(kog_topo("--sysfs-root", str(t)), "class")
    t = tree(tmp_path / "b", "vm_1gpu")
    os.remove(t / "devices/system/node/node0/cpulist")
    assert_one_line_error(kog_topo("--sysfs-root", str(t)), "cpulist")


def test_malformed_link_file(tmp_path):
    t = tree(tmp_path, "h200_hgx")
    (t / "kog-links.json").write_text('{"links": [{"a": "0000:18:00.0"}]}')
    assert_one_line_error(kog_topo("--sysfs-root", str(t)), "kog-links.json")


@pytest.mark.parametrize("content,word", [
    (None, "no such file"),
    ("{not json", "invalid JSON"),
    ('{"foo": 1}', "not amd-smi JSON"),
    ("[1, 2]", "not amd-smi JSON"),
    ('[{"gpu": 0, "asic": {}}]', "bus.bdf"),
    ('{"static": {"gpu": 0}}', "static"),
    ('[{"gpu": 0, "bus": {"bdf": "zz"}}]', "amd-smi"),
])
def test_bad_amd_smi_json(tmp_path, content, word):
    f = tmp_path / "amd.json"
    if content is not None:
        f.write_text(content)
    r = kog_topo("--sysfs-root", os.path.join(FIX, "cpu_2core"), "--amd-smi-json", str(f))
    assert_one_line_error(r, word)


def test_bad_ranks_and_arguments():
    assert_one_line_error(kog_topo("--sysfs-root", os.path.join(FIX, "h200_hgx"), "--ranks", "9"),
                          "9 ranks", "8 GPUs")
    assert_one_line_error(kog_topo("--sysfs-root", os.path.join(FIX, "cpu_2core"), "--ranks", "0"))
    assert_one_line_error(kog_topo("--ranks", "many"), "invalid int")
    assert_one_line_error(kog_topo("--bogus"), "unrecognized")


def test_good_amd_bundle_still_works(tmp_path):
    """Control: the same path through the CLI succeeds with a well-formed file."""
    f = tmp_path / "amd.json"
    doc = json.load(open(os.path.join(FIX, "mi300x_spx_nps1", "amd-smi.json")))
    f.write_text(json.dumps(doc["static"]))                # bare `amd-smi static --json`
    r = kog_topo("--sysfs-root", os.path.join(FIX, "mi300x_spx_nps1"), "--amd-smi-json", str(f), "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["partitions"]) == 8

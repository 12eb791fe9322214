"""hmacore.transport.cpus: two processes pinned to the same CPU find each other; disjoint pins
and unpinned processes report nothing; a dead holder's claim is released."""
import json
import os
import subprocess
import sys

import pytest

from hmacore.transport.cpus import allowed_cpus, claim_pinned_cpus

CHILD = """
import json, os, sys
from hmacore.transport.cpus import claim_pinned_cpus
cpus = json.loads(sys.argv[1])
if cpus is not None:
    os.sched_setaffinity(0, set(cpus))
print(json.dumps({str(k): v for k, v in claim_pinned_cpus(sys.argv[2]).items()}), flush=True)
sys.stdin.readline()          # hold the claim until told to go
"""


class Pinned:
    def __init__(self, cpus, lock_dir):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cpus),
                                      str(lock_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, "child exited early"
        self.taken = {int(k): v for k, v in json.loads(line).items()}

    def close(self):
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=30)


needs_two = pytest.mark.skipif(len(allowed_cpus()) < 2 or not hasattr(os, "sched_setaffinity"),
                               reason="needs 2 CPUs and sched_setaffinity (Linux)")


@needs_two
def test_same_cpu_is_reported_with_the_holder_pid(tmp_path):
    a = Pinned([0], tmp_path)
    try:
        assert a.taken == {}
        b = Pinned([0], tmp_path)
        try:
            assert b.taken == {0: a.proc.pid}
        finally:
            b.close()
        c = Pinned([1], tmp_path)          # disjoint cores: no conflict
        try:
            assert c.taken == {}
        finally:
            c.close()
    finally:
        a.close()
    d = Pinned([0], tmp_path)              # the holder exited: its claim went with it
    try:
        assert d.taken == {}
    finally:
        d.close()


@needs_two
def test_unpinned_process_claims_nothing(tmp_path):
    a = Pinned([0], tmp_path)
    try:
        free = Pinned(None, tmp_path)
        try:
            assert free.taken == {}
        finally:
            free.close()
        assert not list(tmp_path.glob("hmacore-cpu-pin-1"))    # nothing claimed for CPU 1
    finally:
        a.close()


def test_allowed_cpus_covers_this_process():
    assert os.sched_getaffinity(0) <= allowed_cpus()
    assert claim_pinned_cpus() == {} or os.sched_getaffinity(0) < allowed_cpus()

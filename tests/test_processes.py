"""tokenmill.processes: this process's identity, and whether another process has ended."""

import dataclasses
import os
import subprocess
import sys

from tokenmill.processes import ProcessIdentity, is_gone, process_stat


def test_this_process_is_alive():
    me = ProcessIdentity.current()
    assert me.pid == os.getpid() and me.start_time == process_stat(os.getpid())[1]
    assert is_gone(me) is False


def test_a_child_is_alive_then_gone_once_it_has_exited():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        identity = dataclasses.replace(ProcessIdentity.current(), pid=child.pid, start_time=process_stat(child.pid)[1])
        assert is_gone(identity) is False
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert is_gone(identity) is True  # reaped: no such PID


def test_an_exited_child_not_yet_reaped_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = dataclasses.replace(ProcessIdentity.current(), pid=child.pid, start_time=process_stat(child.pid)[1])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, still a zombie
    try:
        assert process_stat(child.pid)[0] == "Z"
        assert is_gone(identity) is True
    finally:
        child.wait(timeout=60)


def test_a_reused_pid_is_gone_and_an_unknown_start_time_is_not_compared():
    me = ProcessIdentity.current()
    earlier = dataclasses.replace(me, start_time=str(int(me.start_time) - 1))  # this PID, another process
    assert is_gone(earlier) is True
    assert is_gone(dataclasses.replace(me, start_time=None)) is False


def test_another_host_or_pid_namespace_cannot_be_told():
    me = ProcessIdentity.current()
    assert is_gone(dataclasses.replace(me, host="some-other-host")) is None
    assert is_gone(dataclasses.replace(me, pid_namespace="pid:[1]")) is None
    assert is_gone(dataclasses.replace(me, host=None)) is None


def test_a_fork_is_another_process():
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        os.write(writer, str(ProcessIdentity.current().pid).encode())
        os._exit(0)
    os.close(writer)
    seen = os.read(reader, 64).decode()
    os.close(reader)
    os.waitpid(pid, 0)
    assert seen == str(pid) and ProcessIdentity.current().pid == os.getpid()

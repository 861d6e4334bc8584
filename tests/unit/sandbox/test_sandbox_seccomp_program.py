"""The actions' seccomp filter read by an interpreter of classic BPF, for every call number: what
the kernel would answer, without a kernel (the integration tests make the calls for real)."""

from __future__ import annotations

import struct

import pytest

from arl_tangram.sandbox import seccomp

pytestmark = pytest.mark.skipif(not seccomp.supported(), reason="only x86-64 has a seccomp table")

ALLOW = seccomp.SECCOMP_RET_ALLOW
EPERM = seccomp.SECCOMP_RET_ERRNO | seccomp.EPERM
ENOSYS = seccomp.SECCOMP_RET_ERRNO | seccomp.ENOSYS


def run(program: bytes, nr: int, arch: int = seccomp.AUDIT_ARCH_X86_64, arg0: int = 0) -> int:
    return execute(program, nr, arch, arg0)[0]


def execute(program: bytes, nr: int, arch: int, arg0: int) -> tuple[int, int]:
    """The classic BPF machine, for the instructions the filter uses, over struct seccomp_data:
    (what the filter returns, how many instructions it ran)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]
    acc, pc, steps = 0, 0, 0
    while True:
        steps += 1
        assert steps <= len(insns), "a filter never jumps backwards: it cannot run longer than itself"
        op, jt, jf, k = insns[pc]
        pc += 1
        if op == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            (acc,) = struct.unpack_from("<I", data, k)
        elif op == 0x06:  # BPF_RET | BPF_K
            return k, steps
        elif op in (0x15, 0x35, 0x45):  # JEQ, JGE, JSET with K
            taken = acc == k if op == 0x15 else acc >= k if op == 0x35 else bool(acc & k)
            pc += jt if taken else jf
        else:
            raise AssertionError(f"instruction {op:#x} not expected in the filter")


PROGRAM = seccomp.program()
DENIED = {nr for group in seccomp.DENIED_X86_64.values() for nr in group.values()}


@pytest.mark.parametrize("nr", range(0, 512))
def test_every_call_number_gets_the_answer_of_the_table(nr: int) -> None:
    # Each call is made with 0 as its first argument: ptrace's request 0 is PTRACE_TRACEME.
    expected = {seccomp.CLONE3_X86_64: ENOSYS, seccomp.PTRACE_X86_64: EPERM}.get(
        nr, EPERM if nr in DENIED else ALLOW
    )
    assert run(PROGRAM, nr) == expected


@pytest.mark.parametrize(
    ("nr", "flags", "expected"),
    [
        (seccomp.CLONE_X86_64, 0x01200011, ALLOW),  # what fork() passes: CHILD_SETTID|CLEARTID|SIGCHLD
        (seccomp.CLONE_X86_64, 0x003D0F00, ALLOW),  # what pthread_create passes
        (seccomp.CLONE_X86_64, seccomp.CLONE_NEWUSER | 17, EPERM),
        (seccomp.CLONE_X86_64, seccomp.CLONE_NEWNET, EPERM),
        (seccomp.CLONE_X86_64, 0x80 | 17, ALLOW),  # in clone's flags 0x80 is part of the exit signal
        (seccomp.CLONE_X86_64, 0x4111, ALLOW),  # what posix_spawn and vfork pass: VM|VFORK|SIGCHLD
        (seccomp.CLONE_X86_64, seccomp.CLONE_PARENT | 17, EPERM),  # a sibling: the zygote's child
        (seccomp.UNSHARE_X86_64, 0x200, ALLOW),  # CLONE_FILES: no namespace
        (seccomp.UNSHARE_X86_64, seccomp.CLONE_NEWNS, EPERM),
        (seccomp.UNSHARE_X86_64, seccomp.CLONE_NEWTIME, EPERM),
    ],
)
def test_clone_and_unshare_are_refused_only_with_a_namespace_flag_or_clone_parent(
    nr: int, flags: int, expected: int
) -> None:
    assert run(PROGRAM, nr, arg0=flags) == expected


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (seccomp.PTRACE_TRACEME, EPERM),  # the caller's parent (the zygote) its tracer
        (16, ALLOW),  # PTRACE_ATTACH (the kernel's own checks apply)
        (0x4206, ALLOW),  # PTRACE_SEIZE
        (0x4200, ALLOW),  # PTRACE_SETOPTIONS
    ],
)
def test_ptrace_is_refused_only_as_traceme(request_: int, expected: int) -> None:
    assert run(PROGRAM, seccomp.PTRACE_X86_64, arg0=request_) == expected


def test_other_abis_are_refused_outright() -> None:
    assert run(PROGRAM, 1, arch=0x40000003) == EPERM  # i386 (int 0x80), whatever the number
    assert run(PROGRAM, seccomp.X32_SYSCALL_BIT | 1) == EPERM  # x32


def test_a_call_costs_a_dozen_instructions_not_one_per_table_entry() -> None:
    """Installing the filter makes the kernel run it for every call number (to cache those it
    always allows): a binary search keeps that run, paid by every action, short."""
    assert len(PROGRAM) // 8 < 256  # jumps are 8-bit
    longest = max(execute(PROGRAM, nr, seccomp.AUDIT_ARCH_X86_64, 0)[1] for nr in range(512))
    assert longest <= 16, longest
